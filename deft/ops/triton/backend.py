"""The ``triton`` backend: DeFT-Flatten on GPU, one partial launch and one merge per layer.

Per step (``plan``, outside any CUDA graph): :func:`deft.plan.plan_step` plans, coarsens
and packs the step into one of the device's pinned host buffers (compiled code for
``flatten``), the buffer is uploaded in one copy, and the fp32 workspace of partial states
is sized; both device buffers are the last plan's when they fit. Per layer (``run``):
:func:`.launch.launch_step` (after a plan's first layer, through the CUDA driver with
arguments packed once: :mod:`.native_launch`). Runs on CUDA tensors, or on CPU tensors under
``TRITON_INTERPRET=1`` (with small blocks, for tests). FP8 K/V (with their scales) load one
byte per element and are dequantised in registers (:mod:`.kernels`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from ...cache.pool import FP8
from ...layout import TreeLayout
from ...plan import Coarsening, plan_step
from ...plan.packing import WORK_FIELDS, PackedPlan, few_rows_share, segment_starts
from ..base import Backend, Capacity, CapacityError, Heads
from .configs import (KernelConfig, block_head_dim, few_rows_config, interpreting, kernel_config,
                      kv_config, light_config)
from .launch import (HEADER, Pointer, Reserved, StepBuffers, has_tma, launch_signature,
                     launch_step)
from .native_launch import driver_launch
from .upload import Staging, staging

__all__ = ["HostStep", "TritonBackend", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256  # the largest block the config table has (heads pad up to a power of two)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _cuda_index(device: torch.device) -> torch.device:
    """``device``, with the current CUDA device's index if it has none."""
    if device.type == "cuda" and device.index is None:
        return _cuda_device(torch.cuda.current_device())
    return device


@functools.lru_cache(maxsize=None)
def _cuda_device(index: int) -> torch.device:
    return torch.device("cuda", index)


def _buffer(previous: torch.Tensor | None, n: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """``previous`` if it is on ``device`` and holds ``n`` elements without being four times
    too large, else a new buffer with a quarter to spare (trees grow every decode step)."""
    if previous is not None and n <= previous.numel() <= 4 * n + 64 and previous.device == device:
        return previous
    return torch.empty(n + n // 4, dtype=dtype, device=device)


def coarsening(cfg: KernelConfig, heads: Heads, device: torch.device) -> Coarsening:
    """The coarsening parameters of ``cfg`` on ``device`` (``resident_per_sm`` holds for
    uncapped launches only: a register cap sets how many programs stay resident)."""
    sms = _num_sms(device)
    resident = cfg.resident_per_sm if cfg.maxnreg is None else None
    return Coarsening(heads.num_qo_heads // heads.num_kv_heads, cfg.block_m, heads.num_kv_heads,
                      sms, cfg.waves, cfg.min_tile_tokens, cfg.max_coarsen,
                      cfg.programs_per_sm * sms, cfg.program_cost, (resident or 0) * sms,
                      cfg.masked_apart, cfg.masked_cost, cfg.node_cut)


class TritonBackend(Backend):
    """DeFT-Flatten on GPU: one partial-attention launch and one merge launch per layer."""

    name = "triton"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    kv_dtypes = (FP8,)
    kv_scales = True
    builds = ("default", "few_rows", "light")
    writes_out = True
    graph_safe = True
    max_slot = 2**31 - 1  # plan arrays are int32 on the device

    def plan(self, layout: TreeLayout, plan_kind: str, block_kv: int, heads: Heads,
             device: torch.device, previous: Any = None,
             kv_dtype: torch.dtype | None = None) -> StepBuffers:
        device = _cuda_index(device)
        reserved = _reserved_of(previous, layout)
        host = staging(device)
        with host.lock:
            reuse, host_buffer = host.next(), host.new
            if reserved is not None:  # room for the header before the segments
                reuse = None if reuse is None else reuse[HEADER:]
                host_buffer = lambda n: host.new(n + HEADER)[HEADER:]  # noqa: E731
            plan, packed, cfg, build = _pack(layout, plan_kind, block_kv, heads, device,
                                             host_buffer, reuse, kv_dtype, _build(reserved))
            return _upload(plan, packed, cfg, build, host, 0, heads, device,
                           previous if isinstance(previous, StepBuffers) else None, reserved)

    def plan_host(self, layout: TreeLayout, plan_kind: str, block_kv: int, heads: Heads,
                  device: torch.device, kv_dtype: torch.dtype | None = None,
                  previous: Any = None) -> HostStep:
        """The packed plan in a pinned buffer of its own (a header's room first), to
        :meth:`upload` to any device like ``device`` (same SM count) whose ``previous`` is
        reserved alike (``previous``: this one's, whose build the plan takes)."""
        device = _cuda_index(device)
        own = Staging(device, raw=False)
        own.next()
        plan, packed, cfg, build = _pack(layout, plan_kind, block_kv, heads, device,
                                         lambda n: own.new(n + HEADER)[HEADER:], None, kv_dtype,
                                         _build(_reserved_of(previous, layout)))
        return HostStep(plan, packed, cfg, build, own, heads, layout.num_queries,
                        _num_sms(device))

    def upload(self, host: HostStep, device: torch.device, previous: Any = None) -> StepBuffers:
        device = _cuda_index(device)
        if _num_sms(device) != host.sms:
            raise ValueError(f"device: the host plan was made for {host.sms} SMs, {device} has "
                             f"{_num_sms(device)}")
        reserved = _reserved_of(previous, host)
        with host.source.lock:  # uploads to several devices may come from several threads
            return _upload(host.plan, host.packed, host.config, host.build, host.source,
                           0 if reserved is not None else HEADER, host.heads, device,
                           previous if isinstance(previous, StepBuffers) else None, reserved)

    def reserve(self, capacity: Capacity, block_kv: int, heads: Heads,
                device: torch.device) -> Reserved:
        """Fixed buffers for every plan of ``capacity``: pass the result as ``previous``."""
        _check_head_dim(heads.head_dim)
        device = _cuda_index(device)
        q, n = capacity.queries, capacity.tokens
        p = capacity.partials if capacity.partials is not None else q * -(-n // block_kv)
        cfg = kernel_config(heads.head_dim, q * heads.num_qo_heads, device)
        g = heads.num_qo_heads // heads.num_kv_heads
        # Every kept tile has a query, so tiles <= partials; a tile of G group queries has
        # ceil(G * g / block_m) work items (block_m the reserved build's: the few-row
        # build's for one-byte K/V).
        build = _build_config(cfg, capacity.build, FP8)
        work = p + -(-p * g // build.block_m)
        starts = segment_starts([n, n, n, n, WORK_FIELDS * work, q, q, q, q + 1, p])
        h, d = heads.num_qo_heads, heads.head_dim
        plse_off = p * h * d
        lse_off = plse_off + -(-p * h // 16) * 16
        # ``graph_waves`` waves of programs, each looping over the plan's (work item, KV
        # head) pairs.
        programs = min(work * heads.num_kv_heads,
                       cfg.graph_waves * cfg.programs_per_sm * _num_sms(device))
        return Reserved(Capacity(q, n, p, capacity.build), work, programs,
                        HEADER + starts[-1],
                        torch.empty(HEADER + starts[-1], dtype=torch.int32, device=device),
                        torch.empty(lse_off + q * h, dtype=torch.float32, device=device),
                        plse_off, lse_off)

    def run(self, prepared: StepBuffers, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, sm_scale: float, *, out: torch.Tensor | None = None,
            lse_out: torch.Tensor | None = None, want_lse: bool = True,
            k_scale: Any = None, v_scale: Any = None,
            captured: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        lse = lse_out
        if lse is None and want_lse:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if k_scale is not None and not isinstance(k_scale, torch.Tensor):  # floats: eager use
            k_scale, v_scale = (torch.tensor([float(x)], dtype=torch.float32, device=q.device)
                                for x in (k_scale, v_scale))
        launch_step(prepared, q, k_cache, v_cache, sm_scale, o, lse, captured, k_scale, v_scale)
        return o, lse


class HostStep(NamedTuple):
    """A step packed on the host (:meth:`TritonBackend.plan_host`), not yet uploaded."""

    plan: Any
    packed: PackedPlan
    config: KernelConfig
    build: str  # the build the tree asks for (``TreeAttention.build``)
    source: Staging  # its pinned buffer: a header's room, then the segments
    heads: Heads
    num_queries: int
    sms: int


def _reserved_of(previous: Any, layout: Any) -> Reserved | None:
    """The reserved buffers ``previous`` holds (if any), checked to fit ``layout``'s queries."""
    reserved = previous if isinstance(previous, Reserved) else getattr(previous, "reserved", None)
    if reserved is not None and layout.num_queries != reserved.capacity.queries:
        raise ValueError(f"layout: expected {reserved.capacity.queries} queries (the reserved "
                         f"capacity's), got {layout.num_queries}")
    return reserved


def _build(reserved: Reserved | None) -> str | None:
    """The build every plan into ``reserved`` launches (None: unreserved, chosen per plan)."""
    return None if reserved is None else reserved.capacity.build


def _build_config(cfg: KernelConfig, build: str, kv_dtype: torch.dtype | None) -> KernelConfig:
    """The config of ``cfg``'s ``build`` over K/V of ``kv_dtype``: ``cfg`` itself where its
    row regime has no such build for that K/V."""
    alt = None
    if build == "few_rows":
        alt = few_rows_config(cfg, kv_dtype)
    elif build == "light":
        alt = light_config(cfg)
    return cfg if alt is None else alt


def _asked_build(plan: Any, packed: PackedPlan, cfg: KernelConfig, launched: KernelConfig,
                 heads: Heads, kv_dtype: torch.dtype | None, device: torch.device) -> str:
    """The build the tree of ``plan`` (packed for ``launched``: ``cfg`` or one of its builds)
    asks for (``TreeAttention.build``), as ``cfg``'s plan of it answers: the few-row share
    is the tiles' (any build's plan has the same groups), the programs are ``launched``'s
    (the same as ``cfg``'s for a tree the light build serves)."""
    g = heads.num_qo_heads // heads.num_kv_heads
    few = few_rows_config(cfg, kv_dtype)
    if few is not None and few_rows_share(plan, g, cfg.block_m, few.block_m) >= cfg.kv8_few_share:
        return "few_rows"
    if (cfg.light_per_sm is not None and launched.block_m == cfg.block_m
            and packed.num_work * heads.num_kv_heads <= cfg.light_per_sm * _num_sms(device)):
        return "light"
    return "default"


def _pack(layout: TreeLayout, plan_kind: str, block_kv: int, heads: Heads,
          device: torch.device, host_buffer: Any, reuse: Any, kv_dtype: torch.dtype | None,
          build: str | None = None) -> tuple[Any, PackedPlan, KernelConfig, str]:
    """Plan, coarsen and pack ``layout`` into ``host_buffer``/``reuse``, with the kernel
    configuration of ``device`` (coarsened for K/V of ``kv_dtype``) of ``build``, or, for
    ``build`` None, of the build its tree asks for. Also returns that build's name."""
    _check_head_dim(heads.head_dim)
    cfg = kernel_config(heads.head_dim, layout.num_queries * heads.num_qo_heads, device)
    launched = cfg if build is None else _build_config(cfg, build, kv_dtype)
    plan, packed = _plan_for(layout, plan_kind, block_kv, heads, device, host_buffer, reuse,
                             kv_config(launched, kv_dtype))
    asked = _asked_build(plan, packed, cfg, launched, heads, kv_dtype, device)
    if build is None and asked != "default":
        launched = _build_config(cfg, asked, kv_dtype)
        plan, packed = _plan_for(layout, plan_kind, block_kv, heads, device, host_buffer,
                                 reuse, kv_config(launched, kv_dtype))
    return plan, packed, launched, asked


def _plan_for(layout: TreeLayout, plan_kind: str, block_kv: int, heads: Heads,
              device: torch.device, host_buffer: Any, reuse: Any, cfg: KernelConfig) -> tuple:
    """:func:`deft.plan.plan_step` for programs of ``cfg`` (its K/V's)."""
    params = coarsening(cfg, heads, device)
    if plan_kind != "flatten":
        # Per-query plans fitted to one resident wave ran 1.3-1.8x slower (docs/decisions.md).
        params = params._replace(resident_slots=0)
    return plan_step(layout, plan_kind, block_kv, params, host_buffer, reuse)


def _check_head_dim(d: int) -> None:
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim: the triton backend takes 1 to {MAX_HEAD_DIM}, got {d}")


def _check_fits(plan: Any, packed: PackedPlan, r: Reserved) -> None:
    """:class:`CapacityError` unless the step fits the reserved buffers (checked before any
    upload, so they keep the last plan that fit)."""
    for what, need, room in (("plan tokens", plan.num_plan_tokens, r.capacity.tokens),
                             ("partial states", plan.num_partials, r.capacity.partials),
                             ("work items", packed.num_work, r.work_capacity),
                             ("plan ints", HEADER + packed.starts[-1], r.plan_ints)):
        if need > room:
            raise CapacityError(what, need, room)


def _upload(plan: Any, packed: PackedPlan, cfg: KernelConfig, build: str, host: Staging,
            start: int, heads: Heads, device: torch.device, previous: StepBuffers | None,
            reserved: Reserved | None) -> StepBuffers:
    """Upload the packed plan (``host``'s current buffer from ``start``, one copy) and size the fp32
    workspace. Both device buffers are ``previous``'s when they fit: the upload and the
    kernels are ordered by the stream (``plan`` and ``run`` on one stream), so the upload
    waits for the old plan's launches. Allocations come first, so a failure leaves
    ``previous`` intact. With ``reserved``, the buffers and workspace offsets are always the
    reserved ones and a header before the segments tells the kernels the plan's sizes (and
    whether its queries are in plan order)."""
    starts, num_queries = packed.starts, plan.num_queries
    n = starts[-1]
    h, head_dim = heads.num_qo_heads, heads.head_dim
    if reserved is not None:
        _check_fits(plan, packed, reserved)
        p, plse_off, lse_off = reserved.capacity.partials, reserved.plse_off, reserved.lse_off
        scratch, plan_buffer, counts = reserved.scratch, reserved.plan_buffer, None
        host.header()[:11] = (packed.num_work, *starts[1:10], packed.sorted_queries)
        host.upload(plan_buffer, HEADER + n)
    else:
        p = max(plan.num_partials, 1)
        # Each workspace starts at a multiple of 16 elements (the kernels are specialised on it).
        plse_off = p * h * head_dim
        lse_off = plse_off + -(-p * h // 16) * 16
        scratch = _buffer(previous.scratch if previous else None, lse_off + num_queries * h,
                          torch.float32, device)
        # Fused merge needs every query to own a partial (else nobody writes its row).
        counts = (torch.zeros(num_queries * h, dtype=torch.int32, device=device)
                  if cfg.fuse_merge and num_queries and packed.every_query_merged else None)
        plan_buffer = _buffer(previous.plan_buffer if previous else None, n, torch.int32, device)
        host.upload(plan_buffer, n, start)
    # Built without the frozen dataclass's ``__init__`` (one ``object.__setattr__`` per
    # field): this runs every step. ``StepBuffers`` has no ``__post_init__``.
    prepared = object.__new__(StepBuffers)
    graph = reserved is not None
    prepared.__dict__.update(
        plan=plan, config=cfg, build=build, plan_buffer=plan_buffer, offsets=tuple(starts),
        scratch=scratch, plse_off=plse_off, lse_off=lse_off, num_work=packed.num_work,
        num_queries=num_queries, num_partials=p, num_qo_heads=h, head_dim=head_dim,
        reserved=reserved,
        programs=reserved.programs if graph else packed.num_work * heads.num_kv_heads,
        # Graph-safe launches are specialised on nothing a plan decides.
        needs_mask=graph or plan.needs_mask,
        contiguous=not graph and cfg.contig and packed.all_contiguous,
        tma=(cfg.contig and cfg.tma and (graph or packed.any_contiguous) and has_tma(device)
             and head_dim == block_head_dim(head_dim)),  # a TMA box is a whole, unpadded head
        sorted_queries=not graph and packed.sorted_queries, counts=counts,
        native=({} if device.type == "cuda" and not interpreting() and driver_launch() is not None
                else None),
    )
    first = HEADER if graph else 0  # where the segments start in the device buffer
    if interpreting():  # the interpreter takes tensors only: views, not pointers
        if graph:
            arrays = (plan_buffer[first:],) * 3
        else:
            arrays = (plan_buffer[:n], prepared.segment("merge_indptr"),
                      prepared.segment("merge_partials"))
        workspaces = (prepared.partial_o, prepared.partial_lse, prepared.lse)
    else:
        base, fbase, i32, f32 = plan_buffer.data_ptr(), scratch.data_ptr(), torch.int32, torch.float32
        seg0 = Pointer(base + 4 * first, i32)
        arrays = ((seg0,) * 3 if graph else
                  (seg0, Pointer(base + 4 * starts[8], i32), Pointer(base + 4 * starts[9], i32)))
        workspaces = (Pointer(fbase, f32), Pointer(fbase + 4 * plse_off, f32),
                      Pointer(fbase + 4 * lse_off, f32))
    prepared.__dict__.update(arrays=arrays, workspaces=workspaces)
    if (prepared.native is not None and previous is not None and previous.native
            and launch_signature(previous) == launch_signature(prepared)):
        prepared.__dict__["native"] = previous.native  # same launches: the same records
    return prepared
