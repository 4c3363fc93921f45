"""Planner: from a :class:`~deft.layout.TreeLayout` to tiles, query groups and a reduction map.

Every plan kind produces the same structure, so one backend executes all of them:

* **plan tokens** — the KV tokens the backend loads, in load order. For the tree plans
  (``flatten``, ``node``, ``node_chunk``) these are the layout's nodes in DFS preorder with
  their slots concatenated: each token once. For ``per_query`` they are every query's whole
  path, so shared tokens repeat (what per-query decoding such as Flash-Decoding reads).
* **tiles** — runs of consecutive plan tokens (CSR ``tile_indptr``). ``flatten`` cuts the
  DFS-ordered tokens into equal tiles of ``block_kv`` that cross node boundaries (with
  ``node_cut``, restarting at every node of at least that many tokens); ``node`` makes one
  tile per node; ``node_chunk`` cuts each node into chunks of at most ``block_kv``.
* **KV-guided query groups** — queries are sorted by the preorder index of their node. The
  queries that see token ``j`` of node ``m`` are then exactly those whose node lies in
  ``m``'s subtree, a contiguous run of sorted queries. A tile's group is therefore the range
  ``[tile_q_start, tile_q_end)`` of sorted queries.
* **compact visibility mask** — three int32 per token and two per query, instead of a bit
  per (query, token) pair. With ``lo, hi`` the preorder interval of the token's node's
  subtree and ``off`` its offset in that node, and ``pre, len`` the query's node preorder
  index and ``query_kv_len``, the query sees the token iff
  ``lo <= pre < hi and (pre != lo or off < len)``.
* **partial states and the reduction map** — one partial ``(o, lse)`` per (tile, group query)
  pair, numbered tile by tile (``partial_indptr``); ``merge_indptr``/``merge_partials`` list
  each query's partials (CSR by original query index) for the exact merge.

All work is vectorised with numpy except one pass over nodes to order them; nothing loops
per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from ..checks import int_at_least, positive_int
from ..layout import TreeLayout

__all__ = ["PLAN_KINDS", "PlanKind", "TreePlan", "make_plan", "assemble", "dfs_preorder"]

PlanKind = Literal["flatten", "node", "node_chunk", "per_query"]
PLAN_KINDS: tuple[str, ...] = ("flatten", "node", "node_chunk", "per_query")

_I = np.int64


@dataclass(frozen=True, eq=False)
class TreePlan:
    """A step's schedule, shared by every layer (all arrays int64 numpy, read-only).

    Shapes: ``T`` tiles, ``N`` plan tokens, ``Q`` queries, ``P`` partial states.
    """

    kind: str
    block_kv: int
    num_layout_tokens: int
    token_slots: np.ndarray  # [N] cache slot of each plan token
    token_lo: np.ndarray  # [N] preorder index of the token's node
    token_hi: np.ndarray  # [N] end of that node's subtree interval in preorder
    token_off: np.ndarray  # [N] offset of the token in its node
    tile_indptr: np.ndarray  # [T + 1] plan-token CSR of each tile
    tile_q_start: np.ndarray  # [T] first sorted query of the tile's group
    tile_q_end: np.ndarray  # [T] one past the last
    partial_indptr: np.ndarray  # [T + 1] partial ids of each tile's group
    query_order: np.ndarray  # [Q] original query index of each sorted position
    query_pre: np.ndarray  # [Q] node preorder index, sorted order
    query_len: np.ndarray  # [Q] query_kv_len, sorted order
    needs_mask: bool  # False when every loaded token is visible to its whole group

    @cached_property
    def _reduction_map(self) -> tuple[np.ndarray, np.ndarray]:
        group = self.tile_q_end - self.tile_q_start
        num_p, num_q = self.num_partials, self.num_queries
        tile_of_p = np.repeat(np.arange(group.shape[0], dtype=_I), group)
        sorted_pos = (self.tile_q_start[tile_of_p] + np.arange(num_p, dtype=_I)
                      - self.partial_indptr[tile_of_p])
        query_of_p = self.query_order[sorted_pos]
        # A stable sort of small integers is a radix sort in numpy.
        key = query_of_p.astype(np.uint16 if num_q <= 1 << 16 else np.uint32)
        partials = np.argsort(key, kind="stable").astype(_I)
        indptr = np.zeros(num_q + 1, _I)
        np.cumsum(np.bincount(query_of_p, minlength=num_q), out=indptr[1:])
        partials.setflags(write=False)
        indptr.setflags(write=False)
        return indptr, partials

    @property
    def merge_indptr(self) -> np.ndarray:
        """``[Q + 1]`` CSR offsets of each (original) query's partial states; built on first use."""
        return self._reduction_map[0]

    @property
    def merge_partials(self) -> np.ndarray:
        """``[P]`` partial-state ids grouped by query (tile order within a query)."""
        return self._reduction_map[1]

    @property
    def num_tiles(self) -> int:
        return int(self.tile_q_start.shape[0])

    @property
    def num_queries(self) -> int:
        return int(self.query_order.shape[0])

    @property
    def num_partials(self) -> int:
        return int(self.partial_indptr[-1])

    @property
    def num_plan_tokens(self) -> int:
        """KV tokens loaded per KV head per layer (a shared token counts once per load)."""
        return int(self.tile_indptr[-1])

    @property
    def max_group(self) -> int:
        return int((self.tile_q_end - self.tile_q_start).max(initial=0))

    @property
    def max_tile_len(self) -> int:
        return int(np.diff(self.tile_indptr).max(initial=0))

    def io_bytes(
        self, num_qo_heads: int, num_kv_heads: int, head_dim: int, elem_bytes: int = 2
    ) -> dict[str, int]:
        """Bytes one layer's attention reads and writes under this plan.

        ``kv``: K and V rows loaded; ``meta``: slot indices, mask encoding and plan arrays;
        ``q``: query rows loaded (once per tile that holds the query); ``partial``: fp32
        partial states written then read by the merge; ``out``: final output and lse.
        """
        n_tok = self.num_plan_tokens
        kv = 2 * n_tok * num_kv_heads * head_dim * elem_bytes
        mask_ints = 3 * n_tok + 2 * self.num_queries if self.needs_mask else 0
        meta = 4 * (n_tok + mask_ints + 4 * self.num_tiles + self.num_partials + self.num_queries)
        q = self.num_partials * num_qo_heads * head_dim * elem_bytes
        partial = 2 * self.num_partials * num_qo_heads * (head_dim + 1) * 4
        out = self.num_queries * num_qo_heads * (head_dim * elem_bytes + 4)
        return {"kv": kv, "meta": meta, "q": q, "partial": partial, "out": out,
                "total": kv + meta + q + partial + out}

    def __repr__(self) -> str:
        return (
            f"TreePlan(kind={self.kind!r}, block_kv={self.block_kv}, tiles={self.num_tiles}, "
            f"plan_tokens={self.num_plan_tokens}, queries={self.num_queries}, "
            f"partials={self.num_partials}, max_group={self.max_group})"
        )


def dfs_preorder(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DFS preorder of a forest: ``order[k]`` is the k-th node, ``size[n]`` its subtree size.

    Children are visited in index order, roots in index order. One pass over nodes.
    """
    n = parents.shape[0]
    if n == 0:
        return np.zeros(0, _I), np.zeros(0, _I)
    # Children CSR (stable, so children keep index order); roots are "children" of n.
    key = np.where(parents < 0, n, parents)
    by_parent = np.argsort(key, kind="stable")
    child_ptr = np.zeros(n + 2, _I)
    np.cumsum(np.bincount(key, minlength=n + 1), out=child_ptr[1:])
    by_parent_l = by_parent.tolist()
    ptr = child_ptr.tolist()
    order: list[int] = []
    stack = by_parent_l[ptr[n]:ptr[n + 1]][::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        lo, hi = ptr[node], ptr[node + 1]
        if hi > lo:
            stack.extend(by_parent_l[lo:hi][::-1])
    order_a = np.asarray(order, dtype=_I)
    # Subtree sizes: accumulate children into parents, deepest first (reverse preorder).
    size = [1] * n
    par = parents.tolist()
    for node in reversed(order):
        p = par[node]
        if p >= 0:
            size[p] += size[node]
    return order_a, np.asarray(size, dtype=_I)


def _segments(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + l)`` for every (s, l) pair, vectorised."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, _I)
    ends = np.cumsum(lens)
    base = np.repeat(starts - (ends - lens), lens)
    return base + np.arange(total, dtype=_I)


def _chunk_bounds(lens: np.ndarray, block: int) -> np.ndarray:
    """Tile lengths that cut each run of ``lens`` into chunks of at most ``block``."""
    lens = lens[lens > 0]
    nchunks = -(-lens // block)
    out = np.full(int(nchunks.sum()), block, _I)
    last = np.cumsum(nchunks) - 1
    out[last] = lens - (nchunks - 1) * block
    return out


def _cut_segments(lens_pre: np.ndarray, node_cut: int) -> np.ndarray:
    """Lengths of the runs of flattened tokens that ``flatten`` cuts into tiles: all of them,
    or with ``node_cut > 0`` a new run at every node of at least ``node_cut`` tokens."""
    total = np.asarray([lens_pre.sum()], _I)
    if node_cut <= 0 or lens_pre.size == 0:
        return total
    starts = np.flatnonzero(lens_pre >= node_cut)
    if starts.size == 0:
        return total
    return np.add.reduceat(lens_pre, np.union1d([0], starts))


def make_plan(layout: TreeLayout, kind: str = "flatten", block_kv: int = 64,
              node_cut: int = 0) -> TreePlan:
    """Plan one step of tree attention over ``layout``.

    Parameters
    ----------
    layout:
        The step's trees and queries.
    kind:
        ``"flatten"`` (DeFT-Flatten, the default), ``"node"``, ``"node_chunk"`` or
        ``"per_query"``; see the module docstring.
    block_kv:
        Tile size in tokens (maximum tile size for ``node_chunk`` and ``per_query``;
        ignored by ``node``).
    node_cut:
        ``flatten`` only: when positive, a tile also starts at the first token of every node
        of at least ``node_cut`` tokens, so such a node shares no tile with the tokens before
        it (a tile of both sides' groups, masked); tiles run ``block_kv`` tokens from there.
    """
    if kind not in PLAN_KINDS:
        raise ValueError(f"kind: expected one of {', '.join(PLAN_KINDS)}, got {kind!r}")
    block_kv = positive_int(block_kv, "block_kv")
    node_cut = int_at_least(node_cut, "node_cut", 0)
    if not isinstance(layout, TreeLayout):
        raise TypeError(f"layout: expected a deft.TreeLayout, got {type(layout).__name__}")

    order, size = dfs_preorder(layout.parents)
    pre = np.empty_like(order)
    pre[order] = np.arange(order.shape[0], dtype=_I)
    lens_pre = layout.node_lens[order]  # node lengths in preorder
    flat_start = np.zeros(order.shape[0] + 1, _I)  # flattened offset of each preorder node
    np.cumsum(lens_pre, out=flat_start[1:])
    # Flattened token arrays (DFS preorder of nodes, tokens in node order).
    flat_pos = _segments(layout.node_kv_indptr[order], lens_pre)
    flat_slots = layout.kv_indices[flat_pos]
    k_of_tok = np.repeat(np.arange(order.shape[0], dtype=_I), lens_pre)
    flat_lo = k_of_tok
    flat_hi = k_of_tok + size[order][k_of_tok]
    flat_off = np.arange(flat_slots.shape[0], dtype=_I) - flat_start[k_of_tok]

    q_pre_orig = pre[layout.query_nodes]
    query_order = np.argsort(q_pre_orig, kind="stable")
    q_pre = q_pre_orig[query_order]
    q_len = layout.query_kv_lens[query_order]

    if kind == "per_query":
        tokens, tile_lens, q_start = _per_query_tokens(
            layout, pre, flat_start, q_pre, q_len, query_order, block_kv
        )
        q_end = q_start + 1
        slots, lo, hi, off = flat_slots[tokens], flat_lo[tokens], flat_hi[tokens], flat_off[tokens]
        needs_mask = False
    else:
        if kind == "flatten":
            tile_lens = _chunk_bounds(_cut_segments(lens_pre, node_cut), block_kv)
        elif kind == "node":
            tile_lens = lens_pre[lens_pre > 0]
        else:
            tile_lens = _chunk_bounds(lens_pre, block_kv)
        slots, lo, hi, off = flat_slots, flat_lo, flat_hi, flat_off
        tile_starts = np.cumsum(tile_lens) - tile_lens
        if tile_lens.size:
            g_lo = lo[tile_starts]  # nodes are in preorder, so the first token has the min
            g_hi = np.maximum.reduceat(hi, tile_starts)
        else:
            g_lo = g_hi = np.zeros(0, _I)
        q_start = np.searchsorted(q_pre, g_lo, side="left")
        q_end = np.searchsorted(q_pre, g_hi, side="left")
        needs_mask = True
        # Drop tiles that no query sees (e.g. finished branches still in the cache).
        keep = q_end > q_start
        if not keep.all():
            keep_tok = np.repeat(keep, tile_lens)
            slots, lo, hi, off = slots[keep_tok], lo[keep_tok], hi[keep_tok], off[keep_tok]
            tile_lens, q_start, q_end = tile_lens[keep], q_start[keep], q_end[keep]

    tile_indptr = np.zeros(tile_lens.shape[0] + 1, _I)
    np.cumsum(tile_lens, out=tile_indptr[1:])
    return assemble(kind, block_kv, layout.num_tokens, needs_mask, slots, lo, hi, off,
                    tile_indptr, q_start, q_end, query_order, q_pre, q_len)


def assemble(kind: str, block_kv: int, num_layout_tokens: int, needs_mask: bool,
             slots: np.ndarray, lo: np.ndarray, hi: np.ndarray, off: np.ndarray,
             tile_indptr: np.ndarray, q_start: np.ndarray, q_end: np.ndarray,
             query_order: np.ndarray, q_pre: np.ndarray, q_len: np.ndarray) -> TreePlan:
    """A plan from its token and tile arrays: numbers the partial states tile by tile (the
    reduction map is built lazily)."""
    partial_indptr = np.zeros(q_start.shape[0] + 1, _I)
    np.cumsum(q_end - q_start, out=partial_indptr[1:])
    arrays = dict(
        token_slots=slots, token_lo=lo, token_hi=hi, token_off=off,
        tile_indptr=tile_indptr, tile_q_start=q_start, tile_q_end=q_end,
        partial_indptr=partial_indptr, query_order=query_order, query_pre=q_pre,
        query_len=q_len,
    )
    for arr in arrays.values():
        arr.setflags(write=False)
    return TreePlan(kind=kind, block_kv=block_kv, num_layout_tokens=num_layout_tokens,
                    needs_mask=needs_mask, **arrays)


def _per_query_tokens(
    layout: TreeLayout,
    pre: np.ndarray,
    flat_start: np.ndarray,
    q_pre: np.ndarray,
    q_len: np.ndarray,
    query_order: np.ndarray,
    block_kv: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sorted query's whole path as flattened-token positions, cut into tiles.

    Returns (tokens, tile_lens, tile's sorted query index). The loop runs once per tree
    level, vectorised over queries.
    """
    nq = q_pre.shape[0]
    node_len = layout.node_lens
    # (query, node, length) runs: the query's own node prefix, then each ancestor.
    run_q = [np.arange(nq, dtype=_I)]
    run_node = [layout.query_nodes[query_order]]
    run_len = [q_len]
    cur = layout.parents[run_node[0]]
    qidx = run_q[0]
    while cur.size:
        alive = cur >= 0
        cur, qidx = cur[alive], qidx[alive]
        if not cur.size:
            break
        run_q.append(qidx)
        run_node.append(cur)
        run_len.append(node_len[cur])
        cur = layout.parents[cur]
    rq, rn, rl = (np.concatenate(x) for x in (run_q, run_node, run_len))
    # Root-first within each query: sort by (query, preorder of node).
    idx = np.lexsort((pre[rn], rq))
    rq, rn, rl = rq[idx], rn[idx], rl[idx]
    tokens = _segments(flat_start[pre[rn]], rl)
    path_len = np.bincount(rq, weights=rl, minlength=nq).astype(_I)
    tile_lens = _chunk_bounds(path_len, block_kv)
    nz = np.flatnonzero(path_len > 0)
    q_of_tile = np.repeat(nz, -(-path_len[nz] // block_kv))
    return tokens, tile_lens, q_of_tile
