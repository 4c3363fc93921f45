"""KV-sequence parallelism: one tree's K/V spread over the ranks of a process group.

The tree's tokens, node by node in depth-first order (a subtree's tokens together), are cut
into ``world_size`` contiguous runs of nearly equal length; rank ``r`` holds and reads only
run ``r`` (:func:`shard_layout` says which slots, and its view of the layout). Every rank
computes each query's partial state ``(o, lse)`` over its run (``lse = -inf`` for a query
that sees none of it), the states are all-gathered, and every rank merges them exactly
(:func:`deft.merge_states`): the attention of the whole tree, on every rank. This is what
lets a prompt's K/V outgrow one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..attention import tree_attention as _local_attention
from ..checks import int_in_range, positive_int
from ..layout import TreeLayout, trusted_layout
from ..merge import merge_states
from ..plan import dfs_preorder

__all__ = ["LayoutShard", "partial_attention", "shard_layout", "tree_attention"]

_I = np.int64


@dataclass(frozen=True)
class LayoutShard:
    """Rank ``rank``'s part of a layout: ``layout`` has the same nodes and queries, each node
    holding only this rank's tokens, at local slots ``0..len(slots) - 1``; ``slots`` are
    their slots in the whole cache (``k_shard = k_cache[slots]``)."""

    layout: TreeLayout
    slots: np.ndarray
    rank: int
    world_size: int


def shard_layout(layout: TreeLayout, world_size: int, rank: int) -> LayoutShard:
    """Rank ``rank``'s shard of ``layout`` among ``world_size`` (see the module docstring)."""
    if not isinstance(layout, TreeLayout):
        raise TypeError(f"layout: expected a deft.TreeLayout, got {type(layout).__name__}")
    world_size = positive_int(world_size, "world_size")
    rank = int_in_range(rank, "rank", 0, world_size - 1)
    indptr = layout.node_kv_indptr
    lens = np.diff(indptr)
    order = dfs_preorder(layout.parents)[0]
    start = np.empty_like(lens)  # each node's first token in the depth-first token order
    start[order] = np.cumsum(lens[order]) - lens[order]
    total = int(lens.sum())
    lo, hi = (total * rank) // world_size, (total * (rank + 1)) // world_size
    first = np.clip(lo - start, 0, lens)  # this rank's tokens of each node: [first, last)
    last = np.clip(hi - start, 0, lens)
    counts = last - first
    local_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(_I)
    slots = np.concatenate([layout.kv_indices[indptr[j] + first[j]:indptr[j] + last[j]]
                            for j in range(lens.shape[0])] or [np.empty(0, _I)]).astype(_I)
    qn = layout.query_nodes
    qlen = np.clip(layout.query_kv_lens - first[qn], 0, counts[qn])
    shard = trusted_layout(layout.parents, local_indptr, np.arange(slots.shape[0], dtype=_I),
                           qn, qlen.astype(_I))
    return LayoutShard(shard, slots, rank, world_size)


def partial_attention(q: torch.Tensor, k_shard: torch.Tensor, v_shard: torch.Tensor,
                      shard: LayoutShard, sm_scale: float | None = None,
                      backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Every query's state over this rank's tokens: ``o [Q, H_q, D]`` in ``q``'s dtype and
    float32 ``lse [Q, H_q]`` (``0`` and ``-inf`` for a query that sees none of them).
    ``k_shard, v_shard``: ``[len(shard.slots), H_kv, D]``."""
    if not isinstance(shard, LayoutShard):
        raise TypeError(f"shard: expected a deft.distributed.LayoutShard, got {type(shard).__name__}")
    n = shard.slots.shape[0]
    for name, t in (("k_shard", k_shard), ("v_shard", v_shard)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != n:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected [{n}, H_kv, D] (one row per slot of the shard), "
                             f"got {got}")
    if n == 0:  # nothing held here: every query's state is empty
        return (torch.zeros_like(q),
                torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device))
    o, lse = _local_attention(q, k_shard, v_shard, shard.layout, sm_scale=sm_scale,
                              backend=backend, return_lse=True)
    return o, lse.float()


def tree_attention(q: torch.Tensor, k_shard: torch.Tensor, v_shard: torch.Tensor,
                   shard: LayoutShard, group: object = None, sm_scale: float | None = None,
                   backend: str = "auto", return_lse: bool = False
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` (every query, the same on every rank) over the whole tree whose
    K/V the ranks of ``group`` (default: the world) hold in shards: this rank's partial
    states, all-gathered, merged. Call it on every rank of the group, with the shard of that
    rank (``shard.rank``/``shard.world_size`` must be the rank's in ``group``). Returns
    ``o [Q, H_q, D]`` (and float32 ``lse [Q, H_q]``) on every rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("deft.distributed.tree_attention: torch.distributed is not "
                           "initialised (dist.init_process_group, e.g. under torchrun)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if (shard.rank, shard.world_size) != (rank, world):
        raise ValueError(f"shard: made for rank {shard.rank} of {shard.world_size}, but this "
                         f"process is rank {rank} of {world} in the group")
    o, lse = partial_attention(q, k_shard, v_shard, shard, sm_scale, backend)
    os_ = [torch.empty_like(o) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(os_, o.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    merged, merged_lse = merge_states(torch.stack(os_, dim=1), torch.stack(lses, dim=1))
    return (merged, merged_lse) if return_lse else merged
