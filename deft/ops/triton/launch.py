"""Launches of the ``triton`` backend's kernels, per layer, from a step's device buffers.

Two launches per layer (one when the merge is fused), with programmatic dependent launch
on sm_90+, no host synchronisation, and no allocation when the caller passes the output
tensors. K/V of tiles with consecutive slots load by TMA inside CUDA-graph capture; eager
launches gather (Triton's per-launch handling of tensor descriptors costs more host time
than TMA saves on the GPU). Outside capture, a plan's first launches of each kind of call go
through Triton, and the later ones call the CUDA driver directly with the arguments Triton
launched, packed once (:mod:`.native_launch`): the same compiled kernels, grids and
arguments at a fraction of the host time.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Union

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ...plan import TreePlan
from ...plan.packing import SEGMENTS
from ..base import Capacity
from ..runtime import capability, has_pdl
from .configs import KernelConfig, block_head_dim, interpreting, kernel_config, kv_config
from .kernels import tree_partial_kernel
from .merge_kernels import merge_kernel
from .native_launch import NativeLaunch, batched, native_launch

__all__ = ["HEADER", "Reserved", "StepBuffers", "Pointer", "launch_step", "launch_merge",
           "launch_signature", "has_tma", "stream_capturing"]

# Ints before the segments of a graph-safe plan buffer: the work-item count, then the
# offsets of segments 1-9 (``SEGMENTS``) from the first.
HEADER = 16


class Pointer:
    """A device address for a Triton pointer argument: what a launch reads of a tensor
    (``data_ptr()`` and ``dtype``), about five times cheaper to make than a tensor view. A
    plan makes 6 of them every step; its buffers keep the memory alive."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


_Ptr = Union[torch.Tensor, Pointer]  # a kernel pointer argument (tensors when interpreting)


@dataclass(frozen=True)
class Reserved:
    """Fixed device buffers of a graph-safe ``TreeAttention`` (``TritonBackend.reserve``)."""

    capacity: Capacity  # with ``partials`` resolved
    work_capacity: int  # work items a plan may have
    programs: int  # the partial launch's grid, always
    plan_ints: int  # the plan buffer's length: header and segments
    plan_buffer: torch.Tensor  # int32
    scratch: torch.Tensor  # fp32 partial o, partial lse and lse workspaces
    plse_off: int
    lse_off: int


@dataclass(frozen=True)
class StepBuffers:
    """A step's device data: two buffers, and the kernels' pointers into them; with the
    step's plan, what ``TritonBackend.plan`` returns."""

    plan: TreePlan
    config: KernelConfig
    build: str  # the build the tree asks for (``TreeAttention.build``)
    plan_buffer: torch.Tensor  # int32 device buffer of the packed plan (may be larger)
    offsets: tuple[int, ...]  # start of each ``SEGMENTS`` segment in it, then the end
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
    reserved: Reserved | None  # the fixed buffers of graph-safe launches, else None
    programs: int  # the partial launch's grid: a program per (work item, KV head), or fixed
    # The plan's driver launches by kind of call (see ``launch_step``; a ``None`` value: that
    # kind is launched by Triton), the last plan's if it launches alike (``launch_signature``);
    # ``None`` where there are none (interpreter, no driver).
    native: dict[tuple, _Native | None] | None = field(compare=False)

    def segment(self, name: str) -> torch.Tensor:
        """The device view of one ``SEGMENTS`` segment, padding included."""
        i, first = SEGMENTS.index(name), HEADER if self.reserved is not None else 0
        return self.plan_buffer[first + self.offsets[i]:first + self.offsets[i + 1]]

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


def launch_step(prepared: StepBuffers, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, sm_scale: float, o: torch.Tensor,
                lse: torch.Tensor | None, captured: bool = False,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """The step's two launches (one when the merge is fused), writing ``o`` and ``lse``
    (``None``: the plan's lse workspace). ``k_scale``, ``v_scale``: float32 ``[1]`` or
    ``[H_kv]`` dequantisation scales of K/V (both or neither). ``captured``: launch as into
    a CUDA graph (a capture's warm-up passes it; a capture itself is detected). Outside
    capture, a call that Triton specialises like one this plan already launched (same
    device, shapes, dtypes, strides, scale, scale tensors, 16-byte aligned q, K, V, o and
    lse) repeats that call's launches through the driver with its own five addresses; its
    first call records them."""
    nq, h_q, d = q.shape
    h_kv = k_cache.shape[1]
    if nq == 0:
        return
    scaled = k_scale is not None
    # Scale tensors are launch arguments the records keep (a layer's are fixed tensors).
    k_s, v_s = (k_scale, v_scale) if scaled else (q, q)
    s_stride = int(scaled and k_scale.shape[0] > 1)
    records, key, done = prepared.native, None, 0
    in_capture = captured or stream_capturing(q.device.type == "cuda")
    if records is not None and not in_capture:
        addresses = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), o.data_ptr(),
                     prepared.workspaces[2].data_ptr() if lse is None else lse.data_ptr())
        device = torch._C._cuda_getDevice()
        key = (device, q.get_device(), q.shape, o.shape, h_kv, q.dtype, k_cache.dtype,
               v_cache.dtype, o.dtype, None if lse is None else lse.dtype, q.stride(),
               k_cache.stride(), v_cache.stride(), o.stride(), sm_scale,
               scaled and (k_scale.data_ptr(), v_scale.data_ptr(), s_stride),
               not (addresses[0] | addresses[1] | addresses[2] | addresses[3] | addresses[4]) & 15)
        found = records.get(key)
        if found is not None:
            done = found(addresses, torch._C._cuda_getCurrentRawStream(device))
            if done == len(found.launches):
                return
            records[key] = None  # the driver refused a launch: Triton launches the rest
    given_q, given_k, given_v = q, k_cache, v_cache
    # Each stride tuple is read once: this runs per layer, and host time adds up eagerly.
    q = q if q.stride(-1) == 1 else q.contiguous()
    qs, ks, os_ = q.stride(), k_cache.stride(), o.stride()
    if v_cache.stride() != ks:  # the kernels address V with K's strides
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
        ks = k_cache.stride()
    cfg, a = kv_config(prepared.config, k_cache.dtype), prepared.arrays
    po, plse, lse_ws = prepared.workspaces
    if cfg.narrow_partials and q.dtype != torch.float32:  # same memory, read as q's dtype
        po = Pointer(po.address, q.dtype) if isinstance(po, Pointer) else po.view(q.dtype)
    h, d_ = prepared.num_qo_heads, prepared.head_dim
    lse = lse_ws if lse is None else lse
    fused = prepared.counts is not None
    pdl = cfg.pdl and has_pdl(q.device)
    header = prepared.reserved is not None
    launches = []  # (compiled kernel, grid, arguments) of each Triton launch, for the driver
    if prepared.programs and not done:
        grid = (prepared.programs,)
        offsets = (0,) * 7 if header else prepared.offsets[1:8]  # graph-safe: in the header
        args = [q, k_cache, v_cache, k_cache, v_cache, po, plse, a[0],
                *offsets, o, lse, prepared.counts if fused else a[1], a[1], a[2],
                sm_scale * math.log2(math.e),
                qs[0], qs[1], ks[0], ks[1], h * d_, d_, h, os_[0], os_[1], h_q, k_s, v_s,
                s_stride]
        kw = dict(G=h_q // h_kv, D=block_head_dim(d), HEAD_D=d, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n,
                  USE_MASK=prepared.needs_mask, CONTIG=prepared.contiguous, TMA=False,
                  SORTED=prepared.sorted_queries, FUSE_MERGE=fused,
                  IEEE=q.dtype == torch.float32, PDL=pdl, HEADER=header, SCALED=scaled,
                  F16_DOTS=q.dtype == torch.bfloat16 and k_cache.dtype.itemsize == 1,
                  ALIGN_MASK=cfg.aligned_mask, RANGES_FIRST=cfg.ranges_first,
                  INF_K=cfg.inf_k(k_cache.dtype, q.dtype),
                  DEFER_V=cfg.deferred_v_checks, IN_ORDER=header and cfg.header_in_order,
                  EARLY=cfg.early_item_loads, SUMS=cfg.sum_checks, ACC_CHECK=cfg.acc_checks,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  maxnreg=cfg.maxnreg,
                  launch_pdl=pdl)
        tma = prepared.tma and _tma_ok(k_cache, ks) and _tma_ok(v_cache, ks)
        # TMA only inside CUDA-graph capture: launched eagerly, Triton's per-launch handling
        # of the tensor descriptors costs more host time than TMA saves on the GPU. Eager
        # launches compile the TMA variant once (``warmup``), so that a capture does not run
        # the compiler.
        capturing = q.device.type != "cuda" or in_capture
        tma_key = ((tuple(kw.values()), q.device, q.dtype, qs, ks, os_)
                   if tma and not capturing else None)
        if tma and (capturing or tma_key not in _TMA_COMPILED):
            tma_args = list(args)
            tma_args[3:5] = (_kv_descriptor(k_cache, ks, cfg.block_n),
                             _kv_descriptor(v_cache, ks, cfg.block_n))
            if capturing:
                args = tma_args
                kw["TMA"] = True
            else:
                tree_partial_kernel.warmup(*tma_args, grid=grid, **{**kw, "TMA": True})
                _TMA_COMPILED.add(tma_key)
        launches.append((tree_partial_kernel[grid](*args, **kw), grid, args, _PARTIAL_INPUTS))
    if not fused:
        merge = launch_merge(po, plse, o, lse, a[1], a[2], pdl, cfg.merge_block,
                             cfg.merge_warps, strides=(h * d_, d_, h), heads=cfg.merge_heads,
                             header=header)
        launches.append((*(merge or (None,) * 3), _MERGE_INPUTS))
    if key is not None and key not in records:
        # Aligned, and nothing copied (a copy's address is not what later calls bind).
        exact = key[-1] and q is given_q and k_cache is given_k and v_cache is given_v
        records[key] = _native(launches) if exact else None


def launch_signature(prepared: StepBuffers) -> tuple:
    """Everything of ``prepared`` that :func:`launch_step` passes to the kernels: plans of
    equal signatures launch alike, so they can share their driver records (graph-safe plans
    of one reservation always do)."""
    header = prepared.reserved is not None
    counts = prepared.counts
    return (prepared.config, prepared.programs, None if header else prepared.offsets[1:8],
            header, tuple((x.data_ptr(), x.dtype) for x in prepared.arrays + prepared.workspaces),
            None if counts is None else counts.data_ptr(), prepared.needs_mask,
            prepared.contiguous, prepared.tma, prepared.sorted_queries, prepared.num_qo_heads,
            prepared.head_dim)


class _Native:
    """A plan's launches of one kind of call, packed for the driver: each call writes its q,
    K, V, o and lse addresses to ``inputs`` and launches them in turn on its stream."""

    __slots__ = ("inputs", "launches", "_batched")

    def __init__(self, inputs: ctypes.Array, launches: tuple[NativeLaunch, ...]) -> None:
        self.inputs, self.launches = inputs, launches
        self._batched = batched(launches, inputs)

    def __call__(self, addresses: tuple[int, ...], stream: int) -> int:
        """How many launches the driver took (all of them, unless it refused one)."""
        if self._batched is not None:
            return self._batched(stream, *addresses)
        self.inputs[:] = addresses
        for i, launch in enumerate(self.launches):
            if not launch(stream):
                return i
        return len(self.launches)


# Argument positions of the partial and merge kernels that read a call's address (q, K, V,
# o, lse: indices of ``_Native.inputs``); K and V twice, as the gathered loads' descriptors.
_PARTIAL_INPUTS = {0: 0, 1: 1, 2: 2, 3: 1, 4: 2, 15: 3, 16: 4}
_MERGE_INPUTS = {2: 3, 3: 4}


def _native(launches: list) -> _Native | None:
    """``launches`` (kernel, grid, arguments, input positions: as Triton just made them)
    packed for the driver, or ``None`` if one cannot be (see :func:`.native_launch`)."""
    inputs = (ctypes.c_uint64 * 5)()
    packed = []
    for kernel, grid, args, bound in launches:
        launch = None if kernel is None else native_launch(kernel, grid, args, inputs, bound)
        if launch is None:
            return None
        packed.append(launch)
    return _Native(inputs, tuple(packed)) if packed else None


_TMA_COMPILED: set[tuple] = set()  # launch keys whose TMA variant an eager launch compiled


def stream_capturing(on_cuda: bool = True) -> bool:
    """Whether this thread's current CUDA stream is capturing a graph; ``on_cuda=False``
    (interpreted CPU tensors) skips asking CUDA."""
    # torch's private call: the public wrapper costs more host time, and this runs per layer.
    return on_cuda and torch._C._cuda_isCurrentStreamCapturing()


def _tma_ok(cache: torch.Tensor, stride: tuple[int, ...]) -> bool:
    """Whether ``cache [slots, H_kv, D]`` (strides ``stride``) can be read as one 2-D TMA
    tensor of rows ``H_kv * D``."""
    _, h, d = cache.shape
    return (stride[2] == 1 and stride[1] == d and stride[0] >= h * d
            and (stride[0] * cache.element_size()) % 16 == 0 and cache.data_ptr() % 16 == 0)


def has_tma(device: torch.device) -> bool:
    """TMA copies exist from sm_90 (Hopper); the interpreter emulates them."""
    return interpreting() or (device.type == "cuda" and capability(device)[0] >= 9)


def _kv_descriptor(cache: torch.Tensor, stride: tuple[int, ...], block_n: int) -> TensorDescriptor:
    """TMA descriptor of ``cache`` as ``[slots, H_kv * D]``, loading ``[block_n, D]`` boxes."""
    slots, h, d = cache.shape
    return TensorDescriptor(cache, [slots, h * d], [stride[0], 1], [block_n, d])


def launch_merge(po: _Ptr, plse: _Ptr, o: torch.Tensor, lse: _Ptr, indptr: _Ptr,
                 indices: _Ptr, pdl: bool = False, block: int | None = None,
                 warps: int | None = None, strides: tuple[int, int, int] | None = None,
                 heads: int | None = None, header: bool = False) -> tuple | None:
    """Merge states ``po [P, H, D]``, ``plse [P, H]`` into ``o [N, H, D]`` and the contiguous
    ``lse [N, H]`` through the CSR map ``indptr [N + 1]``, ``indices`` (int32), ``block``
    states of ``heads`` query heads per step with ``warps`` per program (by default the
    config's shape for this grid). ``strides``: those of ``po`` (rows, heads) and ``plse``
    (rows) when they are raw pointers. ``pdl``: launched to start before the previous launch
    ends (see ``has_pdl``). ``header``: ``indptr`` and ``indices`` are a graph-safe plan's
    first segment, the map's offsets in the header before it. Returns the launch: Triton's
    compiled kernel, the grid and the positional arguments (for :func:`launch_step`)."""
    n, h, d = o.shape
    if block is None or warps is None or heads is None:
        cfg = kernel_config(d, n * h, o.device)
        block = cfg.merge_block if block is None else block
        warps = cfg.merge_warps if warps is None else warps
        heads = cfg.merge_heads if heads is None else heads
    if strides is None:
        strides = (*po.stride()[:2], plse.stride(0))
    small = interpreting()
    grid = (n, -(-h // heads))
    args = (po, plse, o, lse, indptr, indices, h, *strides, *o.stride()[:2])
    kernel = merge_kernel[grid](
        *args, D=block_head_dim(d), HEAD_D=d, BLOCK_S=4 if small else block, BLOCK_H=heads,
        PDL=pdl, HEADER=header,
        num_warps=1 if small else warps, launch_pdl=pdl,
    )
    return kernel, grid, args
