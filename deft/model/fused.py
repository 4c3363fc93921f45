"""Fused Triton kernels of the Llama layer's memory-bound ops, for CUDA tensors.

Each replaces several PyTorch kernels (and their HBM round trips) of a decode step:

* :func:`rms_norm`: optional residual add, then RMSNorm, one read of the row;
* :func:`rope_write`: rotary embedding of the q and k heads of the fused qkv projection,
  straight from the model's cos/sin table, with rotated k and v written into the K/V pool
  slots (quantised by the pool's scales when it has them, as
  :func:`deft.cache.pool.quantize` does) and q into a contiguous buffer for attention;
* :func:`silu_mul`: ``silu(gate) * up`` of the fused gate/up projection.

They round where the PyTorch ops they replace round (the residual sum and the normalised
row in the activations' dtype) except inside RoPE, which is computed in float32 and rounded
once. On sm_90+ each launches with programmatic dependent launch (:func:`chained`; each
program starts with :func:`~deft.ops.runtime.pdl_start`), so a step's launches start while
the one before them ends. The CPU path keeps the plain PyTorch ops (:mod:`deft.model.llama`);
tests compare the two on random inputs (interpreted on CPU, compiled under ``pytest -m gpu``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..ops.columns import head_cols
from ..ops.runtime import has_pdl, pdl_start

__all__ = ["chained", "set_chained", "rms_norm", "rope_write", "silu_mul"]


def _chain_from_env() -> bool:
    """The chain unless ``DEFT_MODEL_PDL=0``."""
    return os.environ.get("DEFT_MODEL_PDL", "1") != "0"


# Read once at import: a step launches ~130 of these kernels and asks at each launch.
_chain = _chain_from_env()


def chained(device: torch.device) -> bool:
    """Whether the model's kernels launch with programmatic dependent launch on ``device``:
    on sm_90+, unless ``DEFT_MODEL_PDL=0`` was set when this module was imported or
    :func:`set_chained` turned it off."""
    return _chain and has_pdl(device)


def set_chained(on: bool) -> None:
    """Turn the launch chain on or off for launches from now on (a CUDA graph keeps what its
    capture launched): to rule the chain out when debugging, or to measure it
    (``tools/model_ab.py``)."""
    global _chain
    _chain = bool(on)


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, X_OUT, n, eps, stride_x, stride_r, stride_o,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:  # the residual stream, rounded to its dtype as ``x + r`` is
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
             .to(tl.float32)).to(x.dtype)
        tl.store(X_OUT + row * n + cols, x, mask=ok)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (w * normed).to(OUT.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * norm(s), s)`` with ``s = x + residual`` (``x`` without one), rows of ``[N, C]``."""
    n_rows, n = x.shape
    out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    s = x if residual is None else torch.empty_like(x)
    r = x if residual is None else residual
    block = triton.next_power_of_2(n)
    if n_rows == 0:
        return out, s
    pdl = chained(x.device)
    _rms_norm_kernel[(n_rows,)](x, r, weight, out, s, n, eps, x.stride(0), r.stride(0),
                                out.stride(0), HAS_RES=residual is not None, BLOCK=block,
                                PDL=pdl, num_warps=min(16, max(1, block // 256)), launch_pdl=pdl)
    return out, s


@triton.jit
def _quantize(x, scale, TOP: tl.constexpr):
    """``x / scale`` saturated at ``±TOP``; NaN where ``x`` is not finite."""
    y = tl.minimum(tl.maximum(x / scale, -TOP), TOP)
    return tl.where(tl.abs(x) < float("inf"), y, float("nan"))


@triton.jit
def _rotate(X, row_stride, heads, cos, sin, OUT, out_row, out_head, S, stride_s,
            HP: tl.constexpr, HALF: tl.constexpr, SCALED: tl.constexpr, TOP: tl.constexpr,
            HALF_P: tl.constexpr, PASS: tl.constexpr, PASS_P: tl.constexpr):
    """Rotate-half RoPE of the first ``2 * HALF`` dims of ``heads`` heads at ``X`` into
    ``OUT``, and the ``PASS`` dims after them as they are (partial rotary); ``SCALED``:
    quantised by the heads' scales at ``S``. ``HALF_P``, ``PASS_P``: those counts rounded up
    to powers of two (the blocks' widths)."""
    hh = tl.arange(0, HP)[:, None]
    c = tl.arange(0, HALF_P)[None, :]
    ok = head_cols(hh < heads, c, HALF, HALF_P)
    x1 = tl.load(X + hh * row_stride + c, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(X + hh * row_stride + HALF + c, mask=ok, other=0.0).to(tl.float32)
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if SCALED:
        s = tl.load(S + hh * stride_s, mask=hh < heads, other=1.0)
        y1, y2 = _quantize(y1, s, TOP), _quantize(y2, s, TOP)
    ty = OUT.dtype.element_ty
    tl.store(OUT + out_row + hh * out_head + c, y1.to(ty), mask=ok)
    tl.store(OUT + out_row + hh * out_head + HALF + c, y2.to(ty), mask=ok)
    if PASS > 0:
        p = 2 * HALF + tl.arange(0, PASS_P)[None, :]
        p_ok = head_cols(hh < heads, p, 2 * HALF + PASS, 2 * HALF + PASS_P)
        y = tl.load(X + hh * row_stride + p, mask=p_ok, other=0.0)
        if SCALED:
            y = _quantize(y.to(tl.float32), s, TOP)
        tl.store(OUT + out_row + hh * out_head + p, y.to(ty), mask=p_ok)


@triton.jit
def _rope_write_kernel(QKV, TABLE, POS, SLOTS, Q_OUT, K, V, KS, VS, h, h_kv, stride_qkv,
                       stride_t, stride_qo, stride_kn, stride_kh, stride_s,
                       HP: tl.constexpr, HKP: tl.constexpr, HALF: tl.constexpr,
                       SCALED: tl.constexpr, TOP: tl.constexpr, HALF_P: tl.constexpr,
                       D: tl.constexpr, D_P: tl.constexpr, PASS_P: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + row).to(tl.int64)
    slot = tl.load(SLOTS + row).to(tl.int64)
    c = tl.arange(0, HALF_P)[None, :]
    if HALF < HALF_P:  # a rotated half that is not a power of two (48: Phi-3, Phi-4-mini)
        cos = tl.load(TABLE + pos * stride_t + c, mask=c < HALF, other=0.0).to(tl.float32)
        sin = tl.load(TABLE + pos * stride_t + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)
    else:
        cos = tl.load(TABLE + pos * stride_t + c).to(tl.float32)
        sin = tl.load(TABLE + pos * stride_t + HALF + c).to(tl.float32)
    d = D
    base = QKV + row * stride_qkv
    _rotate(base, d, h, cos, sin, Q_OUT, row * stride_qo, d, KS, 0, HP, HALF, False, TOP, HALF_P,
            D - 2 * HALF, PASS_P)
    _rotate(base + h * d, d, h_kv, cos, sin, K, slot * stride_kn, stride_kh, KS, stride_s, HKP,
            HALF, SCALED, TOP, HALF_P, D - 2 * HALF, PASS_P)
    hh = tl.arange(0, HKP)[:, None]
    cd = tl.arange(0, D_P)[None, :]
    ok = head_cols(hh < h_kv, cd, D, D_P)
    v = tl.load(base + (h + h_kv) * d + hh * d + cd, mask=ok, other=0.0)
    if SCALED:
        v = _quantize(v.to(tl.float32), tl.load(VS + hh * stride_s, mask=hh < h_kv, other=1.0), TOP)
    tl.store(V + slot * stride_kn + hh * stride_kh + cd, v.to(V.dtype.element_ty), mask=ok)


def rope_write(qkv: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               num_heads: int, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rotated q ``[N, H, D]`` of ``qkv [N, H + 2 H_kv, D]``; rotated k and v go to
    ``k_cache, v_cache [slots, H_kv, D]`` at ``slots``, divided by ``k_scale``, ``v_scale``
    (float32 ``[1]`` or ``[H_kv]``, both or neither) and saturated when given. ``table
    [P, R]``: cos then sin of the ``R <= D`` leading dims RoPE rotates (the rest pass
    through)."""
    n, heads, d = qkv.shape
    h_kv, half = (heads - num_heads) // 2, table.shape[1] // 2
    q = torch.empty((n, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    if qkv.stride(2) != 1 or qkv.stride(1) != d or k_cache.stride() != v_cache.stride() \
            or k_cache.stride(2) != 1 or table.stride(1) != 1:
        raise ValueError("rope_write: expected rows of contiguous heads and a K/V pool of one layout")
    scaled = k_scale is not None
    pdl = chained(qkv.device)
    _rope_write_kernel[(n,)](qkv, table, positions, slots, q, k_cache, v_cache,
                             k_scale if scaled else q, v_scale if scaled else q, num_heads, h_kv,
                             qkv.stride(0), table.stride(0), q.stride(0), k_cache.stride(0),
                             k_cache.stride(1), int(scaled and k_scale.shape[0] > 1),
                             HP=triton.next_power_of_2(num_heads),
                             HKP=triton.next_power_of_2(h_kv), HALF=half,
                             HALF_P=triton.next_power_of_2(half), D=d,
                             D_P=triton.next_power_of_2(d),
                             PASS_P=triton.next_power_of_2(max(d - 2 * half, 1)), SCALED=scaled,
                             TOP=torch.finfo(k_cache.dtype).max, PDL=pdl, num_warps=4,
                             launch_pdl=pdl)
    return q


@triton.jit
def _silu_mul_kernel(GU, OUT, n, stride_gu, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0)
    u = tl.load(GU + row * stride_gu + n + cols, mask=ok, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # silu, rounded as F.silu's
    tl.store(OUT + row * stride_o + cols, (act * u).to(g.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [N, 2 I]`` (gate first), ``[N, I]``."""
    rows, two_i = gate_up.shape
    n = two_i // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows:
        pdl = chained(gate_up.device)
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0),
                                                        out.stride(0), BLOCK=block, PDL=pdl,
                                                        num_warps=4, launch_pdl=pdl)
    return out
