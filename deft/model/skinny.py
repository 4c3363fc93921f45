"""Matmuls of few rows (decode steps) through a Triton kernel where cuBLAS is slower.

At 1 to 64 rows a projection reads its whole weight to produce a few outputs, so its time is
the weight's read. cuBLAS reaches the HBM rate on wide projections (qkv, gate/up) but not on
the ones whose outputs are no wider than their inputs (o, down) nor on the LM head; this
kernel does (``tools/gemm_probe.py``, ``benchmarks/results/gemm_probe_h200.json``). It
streams ``BLOCK_N`` weight rows per program over the whole reduction, accumulates in float32
and rounds once to the activations' dtype, as cuBLAS does; on sm_90+ it launches with
programmatic dependent launch, as :mod:`.fused`'s kernels do, so the wide projections take it
too where that made whole steps faster: qkv up to 16 rows, and gate/up with SiLU·mul fused
into it (:func:`gated`) from 17 to 32 rows where its halves are at least 7,168 wide
(``tools/model_ab.py --switch wide``); o, down and the LM head up to 64 rows (``--switch
rows``). It is taken only inside CUDA-graph captures (and their warm-ups): launched from
Python, a Triton kernel costs more host time than cuBLAS's, and eager steps are host-bound.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..ops.runtime import pdl_start
from .fused import chained, silu_mul

__all__ = ["MAX_ROWS", "gated", "head_proj", "linear", "qkv"]

MAX_ROWS = 64
"""Row counts up to this take the kernel (where :func:`_takes_kernel` allows it)."""

# (BLOCK_N, BLOCK_K, num_stages, num_warps), chosen by a sweep on the H200 at 1-20 rows; from
# 33 rows (64-row blocks, where _NARROW's stages outgrow shared memory) by a sweep on the H100.
_NARROW = (32, 256, 5, 4)  # outputs no wider than inputs: o, down
_NARROW_TALL, _TALL = (32, 128, 5, 4), 32  # the same beyond _TALL rows
_HEAD = (128, 128, 3, 4)  # the LM head
# Outputs wider than inputs (qkv) up to 16 rows, and gate/up fused with SiLU·mul (2 x BLOCK_N
# weight rows per program) from 17 rows where each half is at least 7,168 wide; cuBLAS where
# whole graph steps were faster with it (qkv beyond 16 rows, gate/up below 17), on the H100, or
# where the kernel alone was: halves of 3,584 (Llama-3-8B's gate/up split over 4 GPUs; 56
# programs for 132 SMs) ran 1.2x slower than cuBLAS + silu_mul (the best of seven blocks tied
# it), halves of 7,168 (over 2 GPUs) 4% faster. Widths between were not measured; narrower
# halves take cuBLAS on one GPU too.
_WIDE, _WIDE_ROWS = (64, 256, 3, 4), 16
_GATED, _GATED_ROWS, _GATED_HALF = (64, 128, 3, 4), 17, 7168
_GATED_MAX = 32  # the rows gate/up was measured at


@triton.jit
def _skinny_kernel(X, W, Y, M, N, K, stride_x, stride_w, stride_y, EVEN_N: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_start(PDL)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rm[:, None] < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=row_ok, other=0.0)
        w_at = W + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
        w = tl.load(w_at) if EVEN_N else tl.load(w_at, mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    ok = row_ok & (rn[None, :] < N)
    y = acc.to(X.dtype.element_ty).to(Y.dtype.element_ty)  # rounded as the activations are
    tl.store(Y + rm[:, None] * stride_y + rn[None, :], y, mask=ok)


@triton.jit
def _gated_kernel(X, W, Y, M, N, K, stride_x, stride_w, stride_y, EVEN_N: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PDL: tl.constexpr):
    """``silu(x @ Wg.T) * (x @ Wu.T)`` for ``W = [Wg; Wu]`` (``[2 N, K]``): each program
    streams ``BLOCK_N`` rows of both halves, rounding where ``F.linear`` then
    :func:`~deft.model.fused.silu_mul` round."""
    pdl_start(PDL)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rm[:, None] < M
    col_ok = rn[:, None] < N
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=row_ok, other=0.0)
        g_at = W + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
        u_at = W + (rn[:, None] + N).to(tl.int64) * stride_w + rk[None, :]
        if EVEN_N:
            wg, wu = tl.load(g_at), tl.load(u_at)
        else:
            wg = tl.load(g_at, mask=col_ok, other=0.0)
            wu = tl.load(u_at, mask=col_ok, other=0.0)
        acc_g = tl.dot(x, tl.trans(wg), acc_g)
        acc_u = tl.dot(x, tl.trans(wu), acc_u)
    g = acc_g.to(X.dtype.element_ty).to(tl.float32)
    u = acc_u.to(X.dtype.element_ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty).to(tl.float32)  # silu, as F.silu's
    ok = row_ok & (rn[None, :] < N)
    tl.store(Y + rm[:, None] * stride_y + rn[None, :], (act * u).to(Y.dtype.element_ty), mask=ok)


def _takes_kernel(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int],
                  captured: bool) -> bool:
    """Whether the kernel computes ``x @ w.T`` with block shape ``cfg`` (else cuBLAS does):
    only into CUDA graphs (``captured``: a capture or its warm-up), since launched from
    Python it costs more host time than cuBLAS."""
    k = w.shape[1]
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.shape[1] == k
            and x.dtype in (torch.float16, torch.bfloat16) and w.dtype == x.dtype
            and w.device == x.device and k % cfg[1] == 0 and x.stride(-1) == 1 and w.stride(1) == 1
            and (captured or torch._C._cuda_isCurrentStreamCapturing()))


def _launch(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
            cfg: tuple[int, int, int, int], kernel=_skinny_kernel) -> torch.Tensor:
    """``x @ w.T`` ``[M, N]`` in ``out_dtype`` by the kernel with block shape ``cfg`` (or, with
    ``_gated_kernel``, ``[M, N / 2]``: SiLU of the first half times the second)."""
    (m, k), n = x.shape, w.shape[0]
    if kernel is _gated_kernel:
        n //= 2
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return y
    bn, bk, stages, warps = cfg
    pdl = chained(x.device)
    kernel[(triton.cdiv(n, bn),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        EVEN_N=n % bn == 0, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk,
        PDL=pdl, num_stages=stages, num_warps=warps, launch_pdl=pdl)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           captured: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]``: the kernel for a bias-free projection
    whose outputs are no wider than its inputs (o, down), cuBLAS otherwise."""
    n, k = weight.shape
    cfg = _NARROW if x.shape[0] <= _TALL else _NARROW_TALL
    if bias is None and n <= k and _takes_kernel(x, weight, cfg, captured):
        return _launch(x, weight, x.dtype, cfg)
    return F.linear(x, weight, bias)


def qkv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
        captured: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of the qkv projection: the kernel up to ``_WIDE_ROWS``
    rows for a bias-free weight wider than its input (the measured case), cuBLAS otherwise."""
    n, k = weight.shape
    if (bias is None and n > k and x.shape[0] <= _WIDE_ROWS
            and _takes_kernel(x, weight, _WIDE, captured)):
        return _launch(x, weight, x.dtype, _WIDE)
    return F.linear(x, weight, bias)


def gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          captured: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` of ``F.linear(x, weight, bias)`` (``[M, 2 I]``, gate first) in one
    kernel for a bias-free projection of ``_GATED_ROWS`` to ``_GATED_MAX`` rows with halves
    at least ``_GATED_HALF`` wide, else cuBLAS then :func:`~deft.model.fused.silu_mul`."""
    if (bias is None and _GATED_ROWS <= x.shape[0] <= _GATED_MAX and weight.shape[0] % 2 == 0
            and weight.shape[0] // 2 >= _GATED_HALF
            and _takes_kernel(x, weight, _GATED, captured)):
        return _launch(x, weight, x.dtype, _GATED, _gated_kernel)
    return silu_mul(F.linear(x, weight, bias))


def head_proj(x: torch.Tensor, weight: torch.Tensor, captured: bool = False) -> torch.Tensor:
    """Float32 logits ``F.linear(x, weight).float()`` of the LM head (rounded to ``x``'s dtype
    first, as that is), written as float32 by the kernel at few rows."""
    if _takes_kernel(x, weight, _HEAD, captured):
        return _launch(x, weight, torch.float32, _HEAD)
    return F.linear(x, weight).float()
