"""The ``triton`` backend: checks, workspaces and launches for ``triton_kernels``.

Per step (``refine_plan`` + ``prepare``, outside any CUDA graph): coarsen the DeFT-Flatten
tiles so every program streams about the same number of tokens, flag tiles whose slots
are consecutive (no slot loads) and find where each tile's tokens stop being seen by its
whole group (no mask before that), list the work items (query-row chunks of each tile,
largest tiles first, chunks of one tile adjacent so they share its KV through L2), upload
the plan arrays as int32 and size the fp32 partial-state workspace. For ``flatten`` plans
``plan_fast`` does all of it, planning included, in compiled code (:mod:`deft.fastplan`),
with identical results, reusing the last plan's device buffers when they fit. Per layer
(``run``): two launches (with programmatic dependent launch on sm_90+), no host
synchronisation, and no allocation when the caller passes the output tensors. Runs on CUDA
tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (with small blocks, for tests).
"""

from __future__ import annotations

import functools
import heapq
import math
import os
from typing import Union
from dataclasses import dataclass, replace

import numpy as np
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import fastplan
from ..layout import TreeLayout
from ..plan import TreePlan, coarsen_plan, group_runs
from .triton_kernels import merge_kernel, tree_partial_kernel
from .upload import Staging, staging

__all__ = ["TritonBackend", "KernelConfig", "kernel_config"]


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch shape of the partial kernel."""

    block_m: int  # query rows (query, GQA head) per program
    block_n: int  # KV tokens per inner step
    num_warps: int
    num_stages: int
    waves: float  # programs per SM the coarsened launch aims for
    contig: bool = True  # when every tile's slots are consecutive, skip the slot loads
    tma: bool = False  # with contig: such tiles' K/V by TMA (sm_90+, in CUDA-graph capture only)
    fuse_merge: bool = False  # the last program of a row merges it (no merge launch)
    maxnreg: int | None = None  # register cap per thread (more programs per SM, maybe spills)
    pdl: bool = False  # programmatic dependent launch (sm_90+): starts before the last launch ends
    merge_block: int = 16  # partial states per step of the merge kernel
    merge_warps: int = 2  # warps per merge program
    merge_heads: int = 1  # query heads per merge program (a power of two)
    # Partial o stored in q's dtype for fp16/bf16 (fp32 for fp32): half the bytes the partial
    # kernel writes and the merge reads; lse stays fp32. Each partial is a weighted mean of V
    # rows, so rounding it costs about one more rounding of the output.
    narrow_partials: bool = False
    # Steps of at least ``wide_from`` (query, query head) rows run with ``wide`` instead
    # (which may have a ``wide`` of its own, for even larger steps).
    wide_from: int = 2048
    wide: KernelConfig | None = None

    def for_rows(self, rows: int) -> KernelConfig:
        """The config of a step of ``rows`` (query, query head) rows."""
        if self.wide is not None and rows >= self.wide_from:
            return self.wide.for_rows(rows)
        return self

    def replace_all(self, **changes) -> KernelConfig:
        """This config with ``changes``, in its ``wide`` variants too (for tuning sweeps)."""
        return replace(self, **changes, wide=self.wide and self.wide.replace_all(**changes))


# Keyed by head_dim. 128 is tuned on an H200 (tools/coarsen_sweep.py, docs/benchmarks.md);
# 64 follows it, 256 keeps 8 warps and 2 stages to fit its K/V blocks in shared memory.
# Steps of many queries (2,048 (query, head) rows: speculative and Medusa trees of 64+ nodes,
# 64 leaves on a long prompt) move more partial-state bytes and merge larger grids: their
# merge takes 4 states per step with 1 warp, and the partial kernel writes narrow partials
# under a 168-register cap (converting them costs registers; uncapped, only 2 programs fit
# per SM instead of 3). Measured with SWEEP=mergecfg and SWEEP=partials: 4-10% faster on the
# trees above the threshold, and 2-12% slower than the base config on most trees below it.
# From 8,192 rows (256 queries of 32 heads) a merge program takes 8 heads of a query, 2 of
# its states per step, with 4 warps: 6-15% faster on the two such trees (SWEEP=mergeheads),
# 5-20% slower at 2,048 and 4,096 rows, where the one-head programs already fill the GPU.
_WIDE = dict(merge_block=4, merge_warps=1, narrow_partials=True, maxnreg=168)
_WIDEST = dict(_WIDE, merge_block=2, merge_warps=4, merge_heads=8)
_GPU_CONFIGS = {
    64: KernelConfig(64, 32, 4, 3, 4.0, tma=True, pdl=True),
    128: KernelConfig(64, 32, 4, 3, 4.0, tma=True, pdl=True,
                      wide=KernelConfig(64, 32, 4, 3, 4.0, tma=True, pdl=True, **_WIDE,
                                        wide_from=8192,
                                        wide=KernelConfig(64, 32, 4, 3, 4.0, tma=True, pdl=True,
                                                          **_WIDEST))),
    256: KernelConfig(64, 32, 8, 2, 4.0, tma=True, pdl=True),
}
# Coarsened tiles aim at this many tokens at least, while the launch keeps one program per SM
# (the factor then rounds down to whole plan tiles): shorter loops cost more in prologue and
# epilogue (loads of the work item and Q, partial-state stores) than they gain in balance.
_MIN_TILE_TOKENS = 384
_MAX_COARSEN = 1024  # at most this many plan tiles per coarsened tile
# The launch model of ``_lpt_factor``: partial-kernel programs resident per SM (registers and
# shared memory each allow 3 for head_dim 128 on an H200, ncu; the other head_dims' configs
# are not measured and share the figure), and a program's fixed cost in tokens (loads of its
# work item and Q, partial-state stores).
_PROGRAMS_PER_SM = 3
_PROGRAM_COST = 128
_INTERPRET_CONFIG = KernelConfig(16, 16, 1, 1, 2.0, merge_heads=2)


def _triton_interprets() -> bool:
    """Triton's own reading of ``TRITON_INTERPRET`` (it takes 1, true, on, yes)."""
    try:
        from triton import knobs
    except ImportError:  # Triton before 3.4 read only "1"
        return os.environ.get("TRITON_INTERPRET") == "1"
    return bool(knobs.runtime.interpret)


# Triton picks interpreted or compiled kernels when they are decorated (at import), so the
# mode is read once; planning asks for it several times per step.
_INTERPRETING = _triton_interprets()


def interpreting() -> bool:
    return _INTERPRETING


def kernel_config(head_dim: int) -> KernelConfig:
    if interpreting():
        return _INTERPRET_CONFIG
    return _GPU_CONFIGS.get(head_dim, _GPU_CONFIGS[128])


class _Pointer:
    """A device address for a Triton pointer argument: what a launch reads of a tensor
    (``data_ptr()`` and ``dtype``), about five times cheaper to make than a tensor view. A
    plan makes 6 of them every step; its buffers keep the memory alive."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


_Ptr = Union[torch.Tensor, _Pointer]  # a kernel pointer argument (tensors when interpreting)


@dataclass(frozen=True)
class _Prepared:
    """A step's device data: two buffers, and the kernels' pointers into them."""

    config: KernelConfig
    plan_buffer: torch.Tensor  # int32 device buffer of the packed plan (may be larger)
    offsets: tuple[int, ...]  # start of each ``_SEGMENTS`` segment in it, then the end
    # For the kernels: the packed plan (its first segment, then the others at ``offsets``),
    # the merge indptr and the merge partials segments.
    arrays: tuple[_Ptr, _Ptr, _Ptr]
    scratch: torch.Tensor  # fp32 device buffer of the workspaces (may be larger)
    plse_off: int  # partial lse [P, H_q] starts here (partial o [P, H_q, D] at 0)
    lse_off: int  # lse [Q, H_q] for steps whose caller wants no lse starts here
    workspaces: tuple[_Ptr, _Ptr, _Ptr]  # partial o, partial lse, lse, for the kernels
    num_work: int
    num_queries: int
    num_partials: int  # at least 1, for the workspace shapes
    num_qo_heads: int
    head_dim: int
    needs_mask: bool
    contiguous: bool  # every tile's slots are consecutive (slot0 >= 0)
    tma: bool  # some tile's slots are consecutive and the config and device allow TMA for it
    sorted_queries: bool  # query_order is the identity
    counts: torch.Tensor | None  # [Q * H_q] int32 zeros when the merge is fused, else None

    def segment(self, name: str) -> torch.Tensor:
        """The device view of one ``_SEGMENTS`` segment, padding included."""
        i = _SEGMENTS.index(name)
        return self.plan_buffer[self.offsets[i]:self.offsets[i + 1]]

    @property
    def partial_o(self) -> torch.Tensor:
        p, h, d = self.num_partials, self.num_qo_heads, self.head_dim
        return self.scratch[:p * h * d].view(p, h, d)

    @property
    def partial_lse(self) -> torch.Tensor:
        p, h = self.num_partials, self.num_qo_heads
        return self.scratch[self.plse_off:self.plse_off + p * h].view(p, h)

    @property
    def lse(self) -> torch.Tensor:
        q, h = self.num_queries, self.num_qo_heads
        return self.scratch[self.lse_off:self.lse_off + q * h].view(q, h)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _mask_from(plan: TreePlan) -> np.ndarray:
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


def _tile_slot0(plan: TreePlan) -> np.ndarray:
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


def _work_items(plan: TreePlan, g: int, block_m: int) -> np.ndarray:
    """``[W, 8]`` descriptor of every program: the tile's ``tok0, tok1, q_start, q_end,
    first partial, mask_from, slot0`` and the program's first row. Largest tiles come first;
    the row chunks of one tile are adjacent, so they share its K/V through L2."""
    rows = (plan.tile_q_end - plan.tile_q_start) * g
    chunks = -(-rows // block_m)
    order = np.argsort(-np.diff(plan.tile_indptr), kind="stable")
    tiles = np.repeat(order, chunks[order])
    first = np.cumsum(chunks[order]) - chunks[order]
    row0 = (np.arange(tiles.shape[0]) - np.repeat(first, chunks[order])) * block_m
    per_tile = np.stack([plan.tile_indptr[:-1], plan.tile_indptr[1:], plan.tile_q_start,
                         plan.tile_q_end, plan.partial_indptr[:-1], _mask_from(plan),
                         _tile_slot0(plan)], axis=1)
    return np.concatenate([per_tile[tiles], row0[:, None]], axis=1)


_SEGMENTS = ("tok_slot", "tok_lo", "tok_hi", "tok_off", "work", "q_order", "q_pre", "q_len",
             "merge_indptr", "merge_partials")


def _checked_config(head_dim: int) -> KernelConfig:
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim: the triton backend needs a power of two >= 16, got {head_dim}")
    return kernel_config(head_dim)


def _segment_starts(sizes: list[int]) -> list[int]:
    """Offsets of the packed segments of ``sizes`` (in ``_SEGMENTS`` order), then the total.
    Segments start at multiples of 16 elements (64 bytes), so every segment's pointer has
    the 16-byte alignment the kernels are specialised on."""
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // 16) * 16)
    return starts


def _buffer(previous: torch.Tensor | None, n: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """``previous`` if it is on ``device`` and holds ``n`` elements without being four times
    too large, else a new buffer with a quarter to spare (trees grow every decode step)."""
    if previous is not None and n <= previous.numel() <= 4 * n + 64 and previous.device == device:
        return previous
    return torch.empty(n + n // 4, dtype=dtype, device=device)


def _cuda_index(device: torch.device) -> torch.device:
    """``device``, with the current CUDA device's index if it has none."""
    if device.type == "cuda" and device.index is None:
        return _cuda_device(torch.cuda.current_device())
    return device


@functools.lru_cache(maxsize=None)
def _cuda_device(index: int) -> torch.device:
    return torch.device("cuda", index)


def _finish(cfg: KernelConfig, host: Staging, num_queries: int, starts: list[int],
            device: torch.device, num_qo_heads: int, head_dim: int, num_partials: int,
            num_work: int, needs_mask: bool, all_contiguous: bool, any_contiguous: bool,
            sorted_queries: bool, every_query_merged: bool,
            previous: _Prepared | None) -> _Prepared:
    """Upload the packed plan (``host``'s current buffer, one copy) and size the fp32
    workspace. Both device buffers are ``previous``'s when they fit: the upload and the
    kernels are ordered by the stream (``plan`` and ``run`` on one stream), so the upload
    waits for the old plan's launches. Allocations come first, so a failure leaves
    ``previous`` intact."""
    n = starts[-1]
    p, h = max(num_partials, 1), num_qo_heads
    # Each workspace starts at a multiple of 16 elements (the kernels are specialised on it).
    plse_off = p * h * head_dim
    lse_off = plse_off + -(-p * h // 16) * 16
    scratch = _buffer(previous.scratch if previous else None, lse_off + num_queries * h,
                      torch.float32, device)
    # Fused merge needs every query to own a partial (else nobody writes its row).
    counts = (torch.zeros(num_queries * num_qo_heads, dtype=torch.int32, device=device)
              if cfg.fuse_merge and num_queries and every_query_merged else None)
    plan_buffer = _buffer(previous.plan_buffer if previous else None, n, torch.int32, device)
    host.upload(plan_buffer, n)
    # Built without the frozen dataclass's ``__init__`` (one ``object.__setattr__`` per
    # field, about 5 µs): this runs every step. ``_Prepared`` has no ``__post_init__``.
    prepared = object.__new__(_Prepared)
    prepared.__dict__.update(
        config=cfg, plan_buffer=plan_buffer, offsets=tuple(starts), scratch=scratch,
        plse_off=plse_off, lse_off=lse_off, num_work=num_work, num_queries=num_queries,
        num_partials=p, num_qo_heads=h, head_dim=head_dim, needs_mask=needs_mask,
        contiguous=cfg.contig and all_contiguous,
        tma=cfg.contig and cfg.tma and any_contiguous and _has_tma(device),
        sorted_queries=sorted_queries, counts=counts,
    )
    if interpreting():  # the interpreter takes tensors only: views, not pointers
        arrays = (plan_buffer[:n], prepared.segment("merge_indptr"),
                  prepared.segment("merge_partials"))
        workspaces = (prepared.partial_o, prepared.partial_lse, prepared.lse)
    else:
        base, fbase, i32, f32 = plan_buffer.data_ptr(), scratch.data_ptr(), torch.int32, torch.float32
        arrays = (_Pointer(base, i32), _Pointer(base + 4 * starts[8], i32),
                  _Pointer(base + 4 * starts[9], i32))
        workspaces = (_Pointer(fbase, f32), _Pointer(fbase + 4 * plse_off, f32),
                      _Pointer(fbase + 4 * lse_off, f32))
    prepared.__dict__.update(arrays=arrays, workspaces=workspaces)
    return prepared


def _factor(ratio: float) -> int:
    """The largest ``2^k`` or ``3 * 2^k`` (k >= 0) at most ``ratio``, at least 1."""
    p = 2 ** max(0, math.floor(math.log2(ratio)))
    return 3 * p // 2 if p >= 2 and 1.5 * p <= ratio else p


def _lpt_makespan(runs: list[tuple[int, int]], u: int, heads: int, block_kv: int,
                  slots: int) -> int:
    """Makespan of the partial launch for coarsening factor ``u``, as longest-first list
    scheduling onto ``slots`` identical slots (the order programs start in: work items by
    length, KV heads fastest). A run of ``r`` plan tiles with ``c`` row chunks gives ``r // u``
    tiles of ``u`` plan tiles and one of ``r % u``, each ``c * heads`` programs of
    ``plan tiles * block_kv + _PROGRAM_COST`` tokens. Slot loads are kept as (load, slots)
    groups, so a length class costs a few heap operations."""
    count: dict[int, int] = {}
    for r, c in runs:
        for length, n in ((u, r // u), (r % u, 1)):
            if length and n:
                count[length] = count.get(length, 0) + n * c * heads
    groups = [(0, slots)]
    for length in sorted(count, reverse=True):
        left, cost = count[length], length * block_kv + _PROGRAM_COST
        while left > 0:
            load, m = heapq.heappop(groups)
            k = min(m, left)
            heapq.heappush(groups, (load + cost, k))
            if m > k:
                heapq.heappush(groups, (load, m - k))
            left -= k
    return max(load for load, _ in groups)


def _lpt_factor(plan: TreePlan, factor: int, g: int, block_m: int, heads: int,
                slots: int) -> int:
    """The coarsening factor of the shortest modelled makespan (``_lpt_makespan``; the
    smallest on ties) among ``factor + i * factor // s`` for ``i = 0..s``, ``s = min(factor,
    16)``, up to ``_MAX_COARSEN``: every factor up to twice the rule's when it is at most 16
    (all the benchmark trees), else 17 of them; none when the rule's factor gives one wave
    of programs or more than 8. Planning stays cheap.

    Longer tiles than ``refine_plan``'s rule pay when they leave fewer programs past the last
    full wave of slots: on an H200 (sixth session) this model's choice ran 2-14% faster on 5
    of the 15 benchmark trees and is the rule's own on the others; shorter tiles than the
    rule's, which the model also favours at times, were slower on 4 of 6 trees, hence the
    range."""
    if slots <= 0:
        return factor
    starts = np.flatnonzero(group_runs(plan))
    lens = np.diff(np.append(starts, plan.num_tiles))
    chunks = -(-(plan.tile_q_end[starts] - plan.tile_q_start[starts]) * g // block_m)
    runs = list(zip(lens.tolist(), chunks.tolist()))
    programs = sum(-(-r // factor) * c for r, c in runs) * heads
    # In one wave the rule's factor is best (longer tiles only lengthen the longest
    # program); past 8 waves a last wave costs little.
    if programs <= slots or programs > 8 * slots:
        return factor
    steps = min(factor, 16)
    candidates = [u for u in (factor + i * factor // steps for i in range(steps + 1))
                  if u <= _MAX_COARSEN]
    spans = {u: _lpt_makespan(runs, u, heads, plan.block_kv, slots) for u in candidates}
    return min(spans, key=lambda u: (spans[u], u))


class TritonBackend:
    """DeFT-Flatten on GPU: one partial-attention launch and one merge launch per layer."""

    name = "triton"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    max_slot = 2**31 - 1  # plan arrays are int32 on the device

    def refine_plan(self, plan: TreePlan, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                    device: torch.device) -> TreePlan:
        """Merge same-group tiles into tiles of about ``work / (waves * SMs)`` tokens.

        ``work`` counts (token, query-row chunk, KV head) triples, so each program streams
        about the same number of tokens. The length is at least ``_MIN_TILE_TOKENS`` unless
        that would leave fewer programs than SMs (single-sequence decoding), and is rounded
        down to a factor of ``2^k`` or ``3 * 2^k`` plan tiles. Fixed factors 3..16 swept on an
        H200 over the benchmark trees (docs/benchmarks.md): this rule is 3% off the best
        factor per tree on average (powers of two only, with a 256-token floor: 11%). The
        factor then grows by up to 2x where a model of the launch's waves says fewer,
        longer programs finish sooner (``_lpt_factor``).
        """
        if plan.num_tiles == 0:
            return plan
        cfg = kernel_config(head_dim)
        g = num_qo_heads // num_kv_heads
        chunks = -(-(plan.tile_q_end - plan.tile_q_start) * g // cfg.block_m)
        work = num_kv_heads * float((np.diff(plan.tile_indptr) * chunks).sum())
        sms = _num_sms(device)
        # Interpreted (tests): no floor, so tiny trees keep several tiles and merges.
        floor = 0 if interpreting() else min(_MIN_TILE_TOKENS, work / sms)
        length = max(floor, plan.block_kv, work / (cfg.waves * sms))
        factor = min(_factor(length / plan.block_kv), _MAX_COARSEN)
        return coarsen_plan(plan, _lpt_factor(plan, factor, g, cfg.block_m, num_kv_heads,
                                              _PROGRAMS_PER_SM * sms))

    def prepare(self, plan: TreePlan, layout: TreeLayout, device: torch.device,
                num_qo_heads: int, num_kv_heads: int, head_dim: int) -> _Prepared:
        cfg = _checked_config(head_dim)
        work = _work_items(plan, num_qo_heads // num_kv_heads, cfg.block_m)
        arrays = (plan.token_slots, plan.token_lo, plan.token_hi, plan.token_off,
                  work.reshape(-1), plan.query_order, plan.query_pre, plan.query_len,
                  plan.merge_indptr, plan.merge_partials)
        consecutive = work[:, 6] >= 0
        sizes = [a.shape[0] for a in arrays]
        starts = _segment_starts(sizes)
        device = _cuda_index(device)
        host = staging(device)
        with host.lock:
            buf = host.next()
            if buf is None or buf.numel() < starts[-1]:
                buf = host.new(starts[-1])
            packed = buf.numpy()[:starts[-1]]
            packed.fill(0)
            for a, st in zip(arrays, starts):
                packed[st:st + a.shape[0]] = a
            return _finish(
                cfg, host, plan.num_queries, starts, device, num_qo_heads, head_dim,
                plan.num_partials, int(work.shape[0]), plan.needs_mask,
                bool(consecutive.all()), bool(consecutive.any()),
                bool((plan.query_order == np.arange(plan.num_queries)).all()),
                bool((np.diff(plan.merge_indptr) > 0).all()), None)

    def plan_fast(self, layout: TreeLayout, plan_kind: str, block_kv: int, num_qo_heads: int,
                  num_kv_heads: int, head_dim: int, device: torch.device,
                  previous: _Prepared | None = None) -> tuple[TreePlan, _Prepared] | None:
        """``refine_plan(make_plan(...))`` and ``prepare`` in one compiled pass
        (:mod:`deft.fastplan`), with identical results; ``None`` when it does not apply
        (a plan kind other than ``flatten``, or no compiled planner). The device buffers of
        ``previous`` (the same caller's last plan) are reused when large enough."""
        if plan_kind != "flatten":
            return None
        cfg = _checked_config(head_dim)
        device = _cuda_index(device)
        sms = _num_sms(device)
        params = fastplan.PlanParams(
            num_qo_heads // num_kv_heads, cfg.block_m, num_kv_heads, sms, cfg.waves,
            0 if interpreting() else _MIN_TILE_TOKENS, _MAX_COARSEN, _PROGRAMS_PER_SM * sms,
            _PROGRAM_COST)
        host = staging(device)
        with host.lock:
            fast = fastplan.flatten_plan(layout, block_kv, params, host.new, host.next())
            if fast is None:
                return None
            plan = fast.plan
            return plan, _finish(
                cfg, host, plan.num_queries, fast.starts, device, num_qo_heads, head_dim,
                plan.num_partials, fast.num_work, True, fast.all_contiguous,
                fast.any_contiguous, fast.sorted_queries, fast.every_query_merged,
                previous if isinstance(previous, _Prepared) else None)

    writes_out = True  # run/run_output write into caller-given tensors, allocating nothing

    def run(self, prepared: _Prepared, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, sm_scale: float, out: torch.Tensor | None = None,
            lse_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        lse = (torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
               if lse_out is None else lse_out)
        self._launch(prepared, q, k_cache, v_cache, sm_scale, o, lse)
        return o, lse

    def run_output(self, prepared: _Prepared, q: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, sm_scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Like :meth:`run` but only ``o``; the lse goes to the plan's workspace."""
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        self._launch(prepared, q, k_cache, v_cache, sm_scale, o, None)
        return o

    def _launch(self, prepared: _Prepared, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, sm_scale: float, o: torch.Tensor,
                lse: torch.Tensor | None) -> None:
        """The step's two launches (one when the merge is fused), writing ``o`` and ``lse``
        (``None``: the plan's lse workspace)."""
        nq, h_q, d = q.shape
        h_kv = k_cache.shape[1]
        if nq == 0:
            return
        # Each stride tuple is read once: this runs per layer, and host time adds up eagerly.
        q = q if q.stride(-1) == 1 else q.contiguous()
        qs, ks, os_ = q.stride(), k_cache.stride(), o.stride()
        if v_cache.stride() != ks:  # the kernels address V with K's strides
            k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
            ks = k_cache.stride()
        cfg, a = prepared.config.for_rows(nq * h_q), prepared.arrays
        po, plse, lse_ws = prepared.workspaces
        if cfg.narrow_partials and q.dtype != torch.float32:  # same memory, read as q's dtype
            po = _Pointer(po.address, q.dtype) if isinstance(po, _Pointer) else po.view(q.dtype)
        h, d_ = prepared.num_qo_heads, prepared.head_dim
        lse = lse_ws if lse is None else lse
        fused = prepared.counts is not None
        pdl = cfg.pdl and _has_pdl(q.device)
        if prepared.num_work:
            grid = (prepared.num_work * h_kv,)
            args = [q, k_cache, v_cache, k_cache, v_cache, po, plse, a[0],
                    *prepared.offsets[1:8], o, lse, prepared.counts if fused else a[1], a[1], a[2],
                    sm_scale * math.log2(math.e),
                    qs[0], qs[1], ks[0], ks[1], h * d_, d_, h, os_[0], os_[1], h_q]
            kw = dict(G=h_q // h_kv, D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      USE_MASK=prepared.needs_mask, CONTIG=prepared.contiguous, TMA=False,
                      SORTED=prepared.sorted_queries, FUSE_MERGE=fused,
                      IEEE=q.dtype == torch.float32, PDL=pdl,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
                      launch_pdl=pdl)
            tma = prepared.tma and _tma_ok(k_cache, ks) and _tma_ok(v_cache, ks)
            # TMA only inside CUDA-graph capture: launched eagerly, Triton's per-launch handling
            # of the tensor descriptors costs more host time (about 60 µs per layer on an H200
            # host) than TMA saves on the GPU. Eager launches compile the TMA variant once
            # (``warmup``), so that a capture does not run the compiler.
            capturing = q.device.type != "cuda" or torch.cuda.is_current_stream_capturing()
            key = ((tuple(kw.values()), q.device, q.dtype, qs, ks, os_)
                   if tma and not capturing else None)
            if tma and (capturing or key not in _TMA_COMPILED):
                tma_args = list(args)
                tma_args[3:5] = (_kv_descriptor(k_cache, ks, cfg.block_n),
                                 _kv_descriptor(v_cache, ks, cfg.block_n))
                if capturing:
                    args = tma_args
                    kw["TMA"] = True
                else:
                    tree_partial_kernel.warmup(*tma_args, grid=grid, **{**kw, "TMA": True})
                    _TMA_COMPILED.add(key)
            tree_partial_kernel[grid](*args, **kw)
        if not fused:
            launch_merge(po, plse, o, lse, a[1], a[2], pdl, cfg.merge_block, cfg.merge_warps,
                         strides=(h * d_, d_, h), heads=cfg.merge_heads)


_TMA_COMPILED: set[tuple] = set()  # launch keys whose TMA variant an eager launch compiled


def _tma_ok(cache: torch.Tensor, stride: tuple[int, ...]) -> bool:
    """Whether ``cache [slots, H_kv, D]`` (strides ``stride``) can be read as one 2-D TMA
    tensor of rows ``H_kv * D``."""
    _, h, d = cache.shape
    return (stride[2] == 1 and stride[1] == d and stride[0] >= h * d
            and (stride[0] * cache.element_size()) % 16 == 0 and cache.data_ptr() % 16 == 0)


def _has_tma(device: torch.device) -> bool:
    """TMA copies exist from sm_90 (Hopper); the interpreter emulates them."""
    return interpreting() or (device.type == "cuda" and _capability(device)[0] >= 9)


def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch exists from sm_90; the interpreter lacks ``griddepcontrol``."""
    return not interpreting() and device.type == "cuda" and _capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _kv_descriptor(cache: torch.Tensor, stride: tuple[int, ...], block_n: int) -> TensorDescriptor:
    """TMA descriptor of ``cache`` as ``[slots, H_kv * D]``, loading ``[block_n, D]`` boxes."""
    slots, h, d = cache.shape
    return TensorDescriptor(cache, [slots, h * d], [stride[0], 1], [block_n, d])


def launch_merge(po: _Ptr, plse: _Ptr, o: torch.Tensor, lse: _Ptr, indptr: _Ptr,
                 indices: _Ptr, pdl: bool = False, block: int | None = None,
                 warps: int | None = None, strides: tuple[int, int, int] | None = None,
                 heads: int | None = None) -> None:
    """Merge states ``po [P, H, D]``, ``plse [P, H]`` into ``o [N, H, D]`` and the contiguous
    ``lse [N, H]`` through the CSR map ``indptr [N + 1]``, ``indices`` (int32), ``block``
    states of ``heads`` query heads per step with ``warps`` per program (by default the
    config's shape for this grid). ``strides``: those of ``po`` (rows, heads) and ``plse``
    (rows) when they are raw pointers. ``pdl``: launched to start before the previous launch
    ends (see ``_has_pdl``)."""
    n, h, d = o.shape
    if block is None or warps is None or heads is None:
        cfg = kernel_config(d).for_rows(n * h)
        block = cfg.merge_block if block is None else block
        warps = cfg.merge_warps if warps is None else warps
        heads = cfg.merge_heads if heads is None else heads
    if strides is None:
        strides = (*po.stride()[:2], plse.stride(0))
    small = interpreting()
    merge_kernel[(n, -(-h // heads))](
        po, plse, o, lse, indptr, indices, h, *strides, *o.stride()[:2],
        D=d, BLOCK_S=4 if small else block, BLOCK_H=heads, PDL=pdl,
        num_warps=1 if small else warps, launch_pdl=pdl,
    )
