"""Packing a plan into the kernels' int32 buffer layout.

The buffer holds ``SEGMENTS`` one after the other, each starting at a multiple of 16
elements (64 bytes, so every segment's pointer has the 16-byte alignment the kernels are
specialised on), gaps zeroed. The work items are the programs of the partial-attention
launch: query-row chunks of each tile, largest tiles first, the chunks of one tile adjacent
so they share its K/V through L2. Per tile, ``mask_from`` says where its tokens stop being
seen by its whole group (no mask before it) and ``slot0`` whether its slots are consecutive
(no slot loads). The compiled planner (``flatten_plan.c``) writes exactly this layout.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import numpy as np

from .tree_plan import TreePlan

__all__ = ["SEGMENTS", "HostBuffer", "PackedPlan", "mask_from", "tile_slot0", "work_items",
           "few_rows_share", "segment_starts", "pack"]

SEGMENTS = ("tok_slot", "tok_lo", "tok_hi", "tok_off", "work", "q_order", "q_pre", "q_len",
            "merge_indptr", "merge_partials")
WORK_FIELDS = 8  # tok0, tok1, q_start, q_end, first partial, mask_from, slot0, row0


class HostBuffer(Protocol):
    """A 1-D int32 host buffer the plan is packed into (a CPU ``torch.Tensor`` is one):
    the compiled planner writes at its address, the Python one through its numpy view."""

    def data_ptr(self) -> int: ...

    def numel(self) -> int: ...

    def numpy(self) -> np.ndarray: ...


class PackedPlan(NamedTuple):
    """What packing a plan tells its launcher, besides the buffer's contents."""

    buffer: Any  # the filled HostBuffer (may be longer than ``starts[-1]``)
    starts: list[int]  # offsets of the ``SEGMENTS``, then the packed length
    num_work: int  # work items (rows of ``WORK_FIELDS`` in the ``work`` segment)
    all_contiguous: bool  # every tile's slots are consecutive
    any_contiguous: bool  # some tile's are
    sorted_queries: bool  # query_order is the identity
    every_query_merged: bool  # every query owns at least one partial state

    def segment(self, name: str) -> np.ndarray:
        """The host view of one ``SEGMENTS`` segment, padding included."""
        i = SEGMENTS.index(name)
        return self.buffer.numpy()[self.starts[i]:self.starts[i + 1]]

    def work(self) -> np.ndarray:
        """``[num_work, WORK_FIELDS]`` the work items (a host view)."""
        return self.segment("work")[:WORK_FIELDS * self.num_work].reshape(-1, WORK_FIELDS)


def mask_from(plan: TreePlan) -> np.ndarray:
    """``[T]`` per tile, the first plan token some query of its group may not see (the
    tile's end if they all see all of it): tokens before it need no per-token mask.

    Token ``j`` is seen by the sorted queries whose node lies in ``[lo_j, hi_j)`` (a range
    ``[a_j, b_j)``), except queries on node ``lo_j`` itself with ``query_kv_len <= off_j``;
    the latter is checked against the smallest ``query_kv_len`` on that node (conservative).
    Coarsened tiles often end in a few partly visible tokens (a prompt's last tokens share a
    plan tile with the first branch's), so the split keeps the rest of the tile mask-free.
    """
    if plan.num_tiles == 0:
        return np.zeros(0, np.int64)
    if not plan.needs_mask:
        return plan.tile_indptr[1:].copy()
    num_nodes = int(plan.token_hi.max()) + 1
    first_q = np.searchsorted(plan.query_pre, np.arange(num_nodes + 1), side="left")
    a, b = first_q[plan.token_lo], first_q[plan.token_hi]
    min_len = np.full(num_nodes + 1, np.iinfo(np.int64).max)
    np.minimum.at(min_len, np.minimum(plan.query_pre, num_nodes), plan.query_len)
    tile = np.repeat(np.arange(plan.num_tiles), np.diff(plan.tile_indptr))
    ok = (a <= plan.tile_q_start[tile]) & (b >= plan.tile_q_end[tile])
    ok &= min_len[plan.token_lo] > plan.token_off
    n = ok.shape[0]
    first_bad = np.where(ok, n, np.arange(n))
    return np.minimum(np.minimum.reduceat(first_bad, plan.tile_indptr[:-1]), plan.tile_indptr[1:])


def tile_slot0(plan: TreePlan) -> np.ndarray:
    """``[T]`` first slot of each tile whose slots are consecutive, else -1."""
    if plan.num_tiles == 0:
        return np.zeros(0, np.int64)
    slots = plan.token_slots
    starts = plan.tile_indptr[:-1]
    step_ok = np.ones(slots.shape[0], bool)
    step_ok[1:] = slots[1:] == slots[:-1] + 1
    step_ok[starts] = True
    contig = np.logical_and.reduceat(step_ok, starts)
    return np.where(contig, slots[starts], -1)


def work_items(plan: TreePlan, g: int, block_m: int) -> np.ndarray:
    """``[W, WORK_FIELDS]`` descriptor of every program: the tile's ``tok0, tok1, q_start,
    q_end, first partial, mask_from, slot0`` and the program's first row."""
    rows = (plan.tile_q_end - plan.tile_q_start) * g
    chunks = -(-rows // block_m)
    order = np.argsort(-np.diff(plan.tile_indptr), kind="stable")
    tiles = np.repeat(order, chunks[order])
    first = np.cumsum(chunks[order]) - chunks[order]
    row0 = (np.arange(tiles.shape[0]) - np.repeat(first, chunks[order])) * block_m
    per_tile = np.stack([plan.tile_indptr[:-1], plan.tile_indptr[1:], plan.tile_q_start,
                         plan.tile_q_end, plan.partial_indptr[:-1], mask_from(plan),
                         tile_slot0(plan)], axis=1)
    return np.concatenate([per_tile[tiles], row0[:, None]], axis=1)


def few_rows_share(plan: TreePlan, g: int, block_m: int, few: int) -> float:
    """The share of ``plan``'s token work (each tile's tokens times its work items of
    ``block_m`` rows) in tiles of at most ``few`` rows: how much of a step programs of
    ``few`` rows would serve without re-reading a block (0 for an empty plan)."""
    rows = (plan.tile_q_end - plan.tile_q_start) * g
    tokens = np.diff(plan.tile_indptr).astype(np.int64)
    work = int((tokens * -(-rows // block_m)).sum())
    return float(tokens[rows <= few].sum()) / work if work else 0.0


def segment_starts(sizes: list[int]) -> list[int]:
    """Offsets of segments of ``sizes`` elements, each at a multiple of 16, then the total."""
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // 16) * 16)
    return starts


def pack(plan: TreePlan, g: int, block_m: int, host_buffer: Callable[[int], HostBuffer],
         reuse: HostBuffer | None = None) -> PackedPlan:
    """Pack ``plan`` for programs of ``block_m`` query rows (``g`` query heads per KV head)
    into ``reuse`` when it is large enough, else into ``host_buffer(n)``."""
    work = work_items(plan, g, block_m)
    arrays = (plan.token_slots, plan.token_lo, plan.token_hi, plan.token_off,
              work.reshape(-1), plan.query_order, plan.query_pre, plan.query_len,
              plan.merge_indptr, plan.merge_partials)
    starts = segment_starts([a.shape[0] for a in arrays])
    buf = reuse if reuse is not None and reuse.numel() >= starts[-1] else host_buffer(starts[-1])
    packed = buf.numpy()[:starts[-1]]
    packed.fill(0)
    for a, st in zip(arrays, starts):
        packed[st:st + a.shape[0]] = a
    consecutive = work[:, 6] >= 0
    return PackedPlan(buf, starts, int(work.shape[0]), bool(consecutive.all()),
                      bool(consecutive.any()),
                      bool((plan.query_order == np.arange(plan.num_queries)).all()),
                      bool((np.diff(plan.merge_indptr) > 0).all()))
