"""Coarsening: merge runs of tiles that serve one query group, so every program of the
partial-attention launch streams about the same number of tokens.

:class:`Coarsening` holds what a backend's kernels and device tell the rule (query rows per
program, SMs, programs per SM, a program's fixed cost); :func:`coarsen_factor` is the rule
and its launch model; :func:`coarsen_plan` applies a factor. The compiled planner
(``flatten_plan.c``) implements exactly this specification.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import numpy as np

from ..checks import positive_int
from .packing import mask_from
from .tree_plan import TreePlan, assemble

__all__ = ["Coarsening", "group_runs", "plan_runs", "masked_tiles", "run_masks", "coarsen_plan",
           "coarsen_factor", "modelled_makespan", "refine", "list_makespan", "lpt_makespan",
           "lpt_candidates", "lpt_factor", "launch_programs", "resident_wave"]

_I = np.int64
_INT64_MAX = 2**63 - 1  # the compiled planner's bound: the launch model saturates there


class Coarsening(NamedTuple):
    """The parameters of a step's coarsening, from the kernel config and the device."""

    g: int  # query heads per KV head
    block_m: int  # query rows per program
    num_kv_heads: int
    sms: int
    waves: float  # programs per SM the coarsened launch aims for
    min_tile_tokens: int  # the coarsened tiles' floor in tokens (0: none)
    max_factor: int  # the largest coarsening factor
    slots: int  # the launch model's program slots (programs resident per SM times SMs)
    program_cost: int  # the launch model's fixed cost of a program, in tokens
    # Program slots the kernel really has when fewer than ``slots`` (0: as many), see
    # :func:`resident_wave`.
    resident_slots: int = 0
    # A run's masked last plan tile becomes a tile of its own (see :func:`coarsen_plan`).
    masked_apart: bool = False
    # The launch model charges a tile that holds a masked part this many tokens more (its
    # loop over the masked tokens: per-token ranges and mask), see :func:`run_masks`.
    masked_cost: int = 0
    # Flatten plans also cut tiles at nodes of at least this many tokens where the launch
    # model finishes sooner (0: never), see :func:`~deft.plan.step.flatten_cut`.
    node_cut: int = 0


def group_runs(plan: TreePlan) -> np.ndarray:
    """``[T]`` bool: the tile starts a run of consecutive tiles serving the same query group
    (what :func:`coarsen_plan` merges)."""
    new_run = np.ones(plan.num_tiles, dtype=bool)
    new_run[1:] = (plan.tile_q_start[1:] != plan.tile_q_start[:-1]) | (
        plan.tile_q_end[1:] != plan.tile_q_end[:-1])
    return new_run


def plan_runs(plan: TreePlan, g: int, block_m: int) -> list[tuple[int, int]]:
    """``(plan tiles, row chunks of block_m rows)`` of each run of tiles serving one query
    group (:func:`group_runs`), in plan order."""
    starts = np.flatnonzero(group_runs(plan))
    lens = np.diff(np.append(starts, plan.num_tiles))
    chunks = -(-(plan.tile_q_end[starts] - plan.tile_q_start[starts]) * g // block_m)
    return list(zip(lens.tolist(), chunks.tolist()))


def masked_tiles(plan: TreePlan) -> np.ndarray:
    """``[T]`` bool: the plan tile has a masked part (some group query may not see some of
    its tokens: :func:`~deft.plan.packing.mask_from` before the tile's end)."""
    return mask_from(plan) < plan.tile_indptr[1:]


def run_masks(plan: TreePlan, masked_apart: bool,
              masked: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per run of :func:`plan_runs`: whether its last plan tile has a masked part
    (:func:`masked_tiles`, or ``masked`` when given), and whether :func:`coarsen_plan` with
    ``masked_apart`` cuts that tile off (the run's tile before it has none)."""
    masked = masked_tiles(plan) if masked is None else masked
    ends = np.flatnonzero(np.append(group_runs(plan)[1:], True))
    last = masked[ends]
    if not masked_apart:
        return last, np.zeros_like(last)
    starts = np.append(0, ends[:-1] + 1)
    return last, last & (ends > starts) & ~masked[np.maximum(ends - 1, 0)]


def coarsen_plan(plan: TreePlan, max_tiles: int, masked_apart: bool = False,
                 masked: np.ndarray | None = None) -> TreePlan:
    """Merge runs of consecutive tiles that serve the same query group, up to ``max_tiles``
    tiles each, into one tile: a kernel then keeps one online softmax across them and
    writes one partial state per query instead of ``max_tiles``.

    Groups stay exact (only identical groups merge), so the result is a valid plan of the
    same kind; tiles end where plan tiles end. ``masked_apart``: a run's last
    plan tile, when some group query may not see some of its tokens and every group query
    sees all of the tile before it, stays a tile of its own, so that its masked part (the
    node's last tokens, which a kernel runs with the per-token mask) does not lengthen a
    whole coarsened tile (``masked``: :func:`masked_tiles` of ``plan``, if known).
    """
    max_tiles = positive_int(max_tiles, "max_tiles")
    nt = plan.num_tiles
    if nt == 0 or max_tiles == 1:
        return plan
    idx = np.arange(nt, dtype=_I)
    new_run = group_runs(plan)
    run_start = np.maximum.accumulate(np.where(new_run, idx, 0))
    first = new_run | ((idx - run_start) % max_tiles == 0)
    if masked_apart:
        masked = masked_tiles(plan) if masked is None else masked
        last = np.append(new_run[1:], True)
        first[1:] |= (masked & last)[1:] & ~masked[:-1]
    starts = np.flatnonzero(first)
    tile_indptr = np.append(plan.tile_indptr[starts], plan.tile_indptr[-1])
    return assemble(plan.kind, plan.block_kv, plan.num_layout_tokens, plan.needs_mask,
                    plan.token_slots, plan.token_lo, plan.token_hi, plan.token_off,
                    tile_indptr, plan.tile_q_start[starts], plan.tile_q_end[starts],
                    plan.query_order, plan.query_pre, plan.query_len)


def _factor(ratio: float) -> int:
    """The largest ``2^k`` or ``3 * 2^k`` (k >= 0) at most ``ratio``, at least 1."""
    p = 2 ** max(0, math.floor(math.log2(ratio)))
    return 3 * p // 2 if p >= 2 and 1.5 * p <= ratio else p


def coarsen_factor(plan: TreePlan, c: Coarsening, masked: np.ndarray | None = None) -> int:
    """How many plan tiles of one group become one tile: about ``work / (waves * SMs)``
    tokens, where ``work`` counts (token, query-row chunk, KV head) triples, so each program
    streams about the same number of tokens. The length is at least ``min_tile_tokens``
    unless that would leave fewer programs than SMs (single-sequence decoding), and is
    rounded down to ``2^k`` or ``3 * 2^k`` plan tiles; the factor then grows by up to 2x
    where the launch model says fewer, longer programs finish sooner (:func:`lpt_factor`),
    or up to 4x to fit one wave of the kernel's resident programs (:func:`resident_wave`).
    ``masked``: :func:`masked_tiles` of ``plan``, if known."""
    if plan.num_tiles == 0:
        return 1
    chunks = -(-(plan.tile_q_end - plan.tile_q_start) * c.g // c.block_m)
    work = c.num_kv_heads * float((np.diff(plan.tile_indptr) * chunks).sum())
    floor = min(c.min_tile_tokens, work / c.sms)
    length = max(floor, plan.block_kv, work / (c.waves * c.sms))
    factor = min(_factor(length / plan.block_kv), c.max_factor)
    masks = run_masks(plan, c.masked_apart, masked) if c.masked_cost else None
    return lpt_factor(plan, factor, c.g, c.block_m, c.num_kv_heads, c.slots, c.program_cost,
                      c.max_factor, c.resident_slots, masks, c.masked_cost)


def modelled_makespan(plan: TreePlan, c: Coarsening) -> int:
    """The launch model's makespan of ``plan`` coarsened by :func:`coarsen_factor` (on the
    resident slots where the kernel keeps fewer than ``c.slots``), in tokens; 0 without a
    model (``c.slots <= 0``)."""
    if plan.num_tiles == 0 or c.slots <= 0:
        return 0
    masked = masked_tiles(plan) if c.masked_apart or c.masked_cost else None
    u = coarsen_factor(plan, c, masked)
    slots = c.resident_slots if 0 < c.resident_slots < c.slots else c.slots
    masks = run_masks(plan, c.masked_apart, masked) if c.masked_cost else None
    return lpt_makespan(plan_runs(plan, c.g, c.block_m), u, c.num_kv_heads, plan.block_kv,
                        slots, c.program_cost, masks, c.masked_cost)


def refine(plan: TreePlan, c: Coarsening) -> TreePlan:
    """``plan`` coarsened by :func:`coarsen_factor` (and ``c.masked_apart``)."""
    if plan.num_tiles == 0:
        return plan
    masked = masked_tiles(plan) if c.masked_apart or c.masked_cost else None
    return coarsen_plan(plan, coarsen_factor(plan, c, masked), c.masked_apart, masked)


def list_makespan(classes: list[tuple[int, int]], slots: int) -> int:
    """Makespan of ``(programs, cost)`` classes started in that order, each program on the
    least-loaded of ``slots`` identical slots. Slot loads are kept as (load, slots) groups,
    so a class costs a few heap operations. Loads saturate at ``2**63 - 1``, the compiled
    planner's int64 bound."""
    groups = [(0, slots)]
    for left, cost in classes:
        while left > 0:
            load, m = heapq.heappop(groups)
            k = min(m, left)
            heapq.heappush(groups, (min(load + cost, _INT64_MAX), k))
            if m > k:
                heapq.heappush(groups, (load, m - k))
            left -= k
    return max(load for load, _ in groups)


def lpt_makespan(runs: list[tuple[int, int]], u: int, heads: int, block_kv: int,
                 slots: int, program_cost: int,
                 masks: tuple[np.ndarray, np.ndarray] | None = None,
                 masked_cost: int = 0) -> int:
    """Makespan of the partial launch for coarsening factor ``u``, as longest-first list
    scheduling onto ``slots`` identical slots (the order programs start in: work items by
    length, KV heads fastest). A run of ``r`` plan tiles with ``c`` row chunks gives ``r // u``
    tiles of ``u`` plan tiles and one of ``r % u``, each ``c * heads`` programs of
    ``plan tiles * block_kv + program_cost`` tokens (:func:`list_makespan`). With ``masks``
    (:func:`run_masks`), the tile holding a run's masked last plan tile costs
    ``masked_cost`` more (after the unmasked ones of its length), and a run whose masked
    tile is cut off gives tiles of its other ``r - 1`` plan tiles and that one alone."""
    count: dict[tuple[int, bool], int] = {}
    last, cut = masks if masks is not None else ((False,) * len(runs),) * 2
    for (r, c), m, x in zip(runs, last, cut):
        if x:
            pieces = ((u, (r - 1) // u, False), ((r - 1) % u, 1, False), (1, 1, True))
        else:
            full = (r - 1) // u if m else r // u  # a masked run's last tile, though full
            pieces = ((u, full, False), (r - full * u, 1, bool(m)))
        for length, n, mm in pieces:
            if length and n:
                count[length, mm] = count.get((length, mm), 0) + n * c * heads
    return list_makespan([(count[key], min(key[0] * block_kv + program_cost + masked_cost * key[1],
                                           _INT64_MAX))
                          for key in sorted(count, key=lambda k: (-k[0], k[1]))], slots)


def lpt_candidates(factor: int, max_factor: int) -> list[int]:
    """The factors :func:`lpt_factor` weighs: ``factor + i * factor // s`` for ``i = 0..s``,
    ``s = min(factor, 16)``, up to ``max_factor``."""
    steps = min(factor, 16)
    return [u for u in (factor + i * factor // steps for i in range(steps + 1))
            if u <= max_factor]


def lpt_factor(plan: TreePlan, factor: int, g: int, block_m: int, heads: int,
               slots: int, program_cost: int, max_factor: int, resident_slots: int = 0,
               masks: tuple[np.ndarray, np.ndarray] | None = None,
               masked_cost: int = 0) -> int:
    """The coarsening factor of the shortest modelled makespan (:func:`lpt_makespan`, with
    ``masks`` and ``masked_cost``; the smallest on ties) among ``factor + i * factor // s``
    for ``i = 0..s``, ``s = min(factor, 16)``, up to ``max_factor``: every factor up to
    twice the rule's when it is at most 16, else 17 of them; none when the rule's factor
    gives one wave of programs (longer tiles then only lengthen the longest program) or
    more than 8 (a last wave then costs little). The model runs on ``resident_slots`` where
    the kernel keeps fewer programs than ``slots``, else on ``slots``. Only longer tiles
    than the rule's are candidates: shorter ones that the model favours run slower
    (docs/decisions.md). Then :func:`resident_wave` with ``resident_slots``."""
    if slots <= 0:
        return factor
    fewer = 0 < resident_slots < slots
    model_slots = resident_slots if fewer else slots
    runs = plan_runs(plan, g, block_m)
    best = factor
    programs = launch_programs(runs, factor, heads)
    if model_slots < programs <= 8 * model_slots:
        spans = {u: lpt_makespan(runs, u, heads, plan.block_kv, model_slots, program_cost,
                                 masks, masked_cost)
                 for u in lpt_candidates(factor, max_factor)}
        best = min(spans, key=lambda u: (spans[u], u))
    if fewer:
        best = resident_wave(runs, best, min(4 * factor, max_factor), heads, plan.block_kv,
                             resident_slots, program_cost)
    return best


def launch_programs(runs: list[tuple[int, int]], u: int, heads: int) -> int:
    """Programs of the launch at coarsening factor ``u`` of ``runs`` (:func:`plan_runs`)."""
    return sum(-(-r // u) * c for r, c in runs) * heads


def resident_wave(runs: list[tuple[int, int]], u: int, limit: int, heads: int, block_kv: int,
                  resident_slots: int, program_cost: int) -> int:
    """``u``, or the smallest factor up to ``limit`` whose programs fit in one wave of
    ``resident_slots`` if the launch model on those slots finishes it sooner. The slots are
    the programs the kernel really keeps per SM times SMs, where its registers allow fewer
    than the launch model's (the uncapped head_dim-128 build: 2 per SM, not 3): a launch the
    model sees as one wave then runs as two, the second mostly idle (a 32k-token prompt
    with 16 queries: 376 programs on 264 slots; docs/decisions.md)."""
    if launch_programs(runs, u, heads) <= resident_slots or limit <= u:
        return u
    if launch_programs(runs, limit, heads) > resident_slots:
        return u
    lo, hi = u, limit  # programs(lo) > resident_slots >= programs(hi): bisect
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if launch_programs(runs, mid, heads) <= resident_slots:
            hi = mid
        else:
            lo = mid
    one = lpt_makespan(runs, hi, heads, block_kv, resident_slots, program_cost)
    return hi if one < lpt_makespan(runs, u, heads, block_kv, resident_slots, program_cost) else u
