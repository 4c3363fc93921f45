"""One decode step's trees as attention sees them, validated once.

A layout is a forest of *nodes*. Node ``n`` holds the cache slots
``kv_indices[node_kv_indptr[n]:node_kv_indptr[n + 1]]`` and has parent
``parents[n]`` (``-1`` for a root). Query ``i`` belongs to node ``query_nodes[i]``
and sees every token of that node's ancestors plus the first
``query_kv_lens[i]`` tokens of its own node (all of them by default).

The layout touches no K/V tensors; it holds int64 numpy arrays only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TreeLayout", "as_index_array", "trusted_layout"]


def as_index_array(value: Any, name: str) -> np.ndarray:
    """Turn a list, numpy array or integer tensor into a 1-D int64 numpy array.

    Raises ``TypeError`` naming ``name`` for floats, booleans or other types and
    ``ValueError`` for a wrong number of dimensions.
    """
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor
        if value.is_floating_point() or value.is_complex() or str(value.dtype) == "torch.bool":
            raise TypeError(f"{name}: expected an integer tensor, got dtype {value.dtype}")
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected a sequence of integers, got {type(value).__name__}") from exc
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {tuple(arr.shape)}")
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """A validated forest of KV nodes and the queries that attend to it.

    Parameters
    ----------
    parents:
        ``[num_nodes]`` parent node index, ``-1`` for a root.
    node_kv_indptr:
        ``[num_nodes + 1]`` CSR offsets into ``kv_indices``; starts at 0, non-decreasing.
    kv_indices:
        ``[node_kv_indptr[-1]]`` cache slot of each node token, in token order.
    query_nodes:
        ``[num_queries]`` node each query belongs to.
    query_kv_lens:
        ``[num_queries]`` how many tokens of its own node each query sees
        (0 to the node's length); ``None`` means all of them.
    """

    parents: np.ndarray
    node_kv_indptr: np.ndarray
    kv_indices: np.ndarray
    query_nodes: np.ndarray
    query_kv_lens: np.ndarray

    def __init__(
        self,
        parents: Any,
        node_kv_indptr: Any,
        kv_indices: Any,
        query_nodes: Any,
        query_kv_lens: Any = None,
    ) -> None:
        parents_a = as_index_array(parents, "parents")
        indptr = as_index_array(node_kv_indptr, "node_kv_indptr")
        kv = as_index_array(kv_indices, "kv_indices")
        qn = as_index_array(query_nodes, "query_nodes")
        n = parents_a.shape[0]
        _check_parents(parents_a)
        _check_indptr(indptr, n, kv.shape[0])
        if kv.size and kv.min() < 0:
            i = int(np.argmax(kv < 0))
            raise ValueError(f"kv_indices[{i}]: expected a slot >= 0, got {int(kv[i])}")
        if qn.size:
            bad = (qn < 0) | (qn >= n)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(
                    f"query_nodes[{i}]: expected a node index in [0, {n}), got {int(qn[i])}"
                )
        node_len = np.diff(indptr)
        if query_kv_lens is None:
            qlen = node_len[qn] if qn.size else np.zeros(0, np.int64)
        else:
            qlen = as_index_array(query_kv_lens, "query_kv_lens")
            if qlen.shape != qn.shape:
                raise ValueError(
                    f"query_kv_lens: expected shape ({qn.shape[0]},) like query_nodes, "
                    f"got ({qlen.shape[0]},)"
                )
            if qlen.size:
                cap = node_len[qn]
                bad = (qlen < 0) | (qlen > cap)
                if bad.any():
                    i = int(np.argmax(bad))
                    raise ValueError(
                        f"query_kv_lens[{i}]: expected 0..{int(cap[i])} (length of node "
                        f"{int(qn[i])}), got {int(qlen[i])}"
                    )
        for name, arr in (
            ("parents", parents_a),
            ("node_kv_indptr", indptr),
            ("kv_indices", kv),
            ("query_nodes", qn),
            ("query_kv_lens", qlen),
        ):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    @property
    def num_queries(self) -> int:
        return int(self.query_nodes.shape[0])

    @property
    def num_tokens(self) -> int:
        """Number of KV tokens held by all nodes (each counted once)."""
        return int(self.kv_indices.shape[0])

    @property
    def node_lens(self) -> np.ndarray:
        """``[num_nodes]`` tokens per node."""
        return np.diff(self.node_kv_indptr)

    def __repr__(self) -> str:
        return (
            f"TreeLayout(num_nodes={self.num_nodes}, num_tokens={self.num_tokens}, "
            f"num_queries={self.num_queries})"
        )

    @classmethod
    def from_node_lengths(
        cls,
        parents: Any,
        node_lens: Any,
        query_nodes: Any,
        query_kv_lens: Any = None,
        slots: Any = None,
    ) -> "TreeLayout":
        """Build a layout whose nodes take consecutive slots (or ``slots``, if given)."""
        lens = as_index_array(node_lens, "node_lens")
        if lens.size and lens.min() < 0:
            i = int(np.argmax(lens < 0))
            raise ValueError(f"node_lens[{i}]: expected a length >= 0, got {int(lens[i])}")
        indptr = np.zeros(lens.shape[0] + 1, np.int64)
        np.cumsum(lens, out=indptr[1:])
        kv = np.arange(indptr[-1], dtype=np.int64) if slots is None else slots
        return cls(parents, indptr, kv, query_nodes, query_kv_lens)


def trusted_layout(parents: np.ndarray, node_kv_indptr: np.ndarray, kv_indices: np.ndarray,
                   query_nodes: np.ndarray, query_kv_lens: np.ndarray) -> TreeLayout:
    """A :class:`TreeLayout` of int64 arrays that are valid by construction, unchecked: for
    code that builds every step's layout from state it keeps valid (the tree cache, a
    padded layout), where the checks would cost host time on the critical path each step.
    The arrays are frozen (read-only) but not copied."""
    layout = object.__new__(TreeLayout)
    for name, arr in (("parents", parents), ("node_kv_indptr", node_kv_indptr),
                      ("kv_indices", kv_indices), ("query_nodes", query_nodes),
                      ("query_kv_lens", query_kv_lens)):
        arr.setflags(write=False)
        object.__setattr__(layout, name, arr)
    return layout


def _check_parents(parents: np.ndarray) -> None:
    n = parents.shape[0]
    if n == 0:
        return
    bad = (parents < -1) | (parents >= n)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"parents[{i}]: expected -1 (root) or a node index in [0, {n}), got {int(parents[i])}"
        )
    # Pointer doubling: after k rounds anc[i] is the 2^k-th ancestor (or -1). A node
    # that still has an ancestor after 2^k >= n hops lies on or below a cycle.
    anc = parents.copy()
    hops = 1
    while hops < n and (anc >= 0).any():
        anc = np.where(anc >= 0, anc[np.maximum(anc, 0)], -1)
        hops *= 2
    cyclic = anc >= 0
    if cyclic.any():
        # Report a node that is itself on the cycle: walk n steps from the first hit.
        i = int(np.argmax(cyclic))
        on_cycle = i
        for _ in range(n):
            on_cycle = int(parents[on_cycle])
        raise ValueError(
            f"parents: expected a forest, but node {on_cycle} is its own ancestor (a cycle)"
        )


def _check_indptr(indptr: np.ndarray, num_nodes: int, num_kv: int) -> None:
    if indptr.shape[0] != num_nodes + 1:
        raise ValueError(
            f"node_kv_indptr: expected length num_nodes + 1 = {num_nodes + 1}, got {indptr.shape[0]}"
        )
    if indptr[0] != 0:
        raise ValueError(f"node_kv_indptr[0]: expected 0, got {int(indptr[0])}")
    dec = np.diff(indptr) < 0
    if dec.any():
        i = int(np.argmax(dec))
        raise ValueError(
            f"node_kv_indptr[{i + 1}]: expected >= node_kv_indptr[{i}] = {int(indptr[i])}, "
            f"got {int(indptr[i + 1])}"
        )
    if indptr[-1] != num_kv:
        raise ValueError(
            f"node_kv_indptr[-1]: expected len(kv_indices) = {num_kv}, got {int(indptr[-1])}"
        )
