"""Skinny matmuls of a decode step: cuBLAS (``F.linear``) against its alternatives.

For each Llama-3-8B projection (qkv, o, gate_up, down, LM head; and gate_up followed by
SiLU·mul, against :func:`deft.model.skinny.gated`'s fused kernel) and each row count, times 32
calls replayed as one CUDA graph, cycling through enough weight copies that every call reads
its weight from HBM, and prints µs per call and the weight's read bandwidth: ``F.linear``
through cuBLAS and through cuBLASLt, the transposed product ``W @ xᵀ`` (its output is
``[N, M]``, so a user would pay a transpose on top), and the kernel of
:mod:`deft.model.skinny`, best of a few block shapes and pipeline depths (the block shapes
that module takes were chosen from this table).

Usage: python3 tools/gemm_probe.py [ROWS ...]   (GPU only; default rows 1 4 16 20)
"""
import itertools

import torch
import torch.nn.functional as F
import triton

from deft.model.fused import silu_mul
from deft.model.skinny import _gated_kernel, _launch, _skinny_kernel
from _usage import args

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "gate_up+silu": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
ROWS = [int(r) for r in args(__doc__)] or [1, 4, 16, 20]
CALLS = 32


def skinny(x, w, cfg, gated=False):
    return _launch(x, w, x.dtype, cfg, _gated_kernel if gated else _skinny_kernel)


def product(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    """The float64 reference: ``x @ w.T``, or SiLU of its first half times its second."""
    y = F.linear(x.double(), w.double())
    if not gated:
        return y
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(g.replay, return_mode="median") * 1e3 / CALLS


CONFIGS = [c for c in itertools.product((16, 32, 64, 128), (128, 256, 512), (3, 5), (4, 8))
           if c[0] * c[1] <= 128 * 128]
dev, dt = "cuda", torch.bfloat16


def lt_linear(x, w):
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


print("shape | rows | cuBLAS µs | cuBLASLt µs | W·xᵀ µs | GB/s (cuBLAS) | best Triton µs | GB/s "
      "| config (BN, BK, stages, warps)")
for name, (n, k) in SHAPES.items():
    size = n * k * 2
    copies = max(2, -(-600_000_000 // size))
    ws = [torch.randn(n, k, device=dev, dtype=dt) / 64 for _ in range(copies)]
    gated = name.endswith("+silu")
    after = silu_mul if gated else (lambda y: y)
    for m in ROWS:
        x = torch.randn(m, k, device=dev, dtype=dt)
        ref = product(x, ws[0], gated)
        t_blas = graph_us(lambda: [after(F.linear(x, ws[i % copies])) for i in range(CALLS)])
        t_lt = graph_us(lambda: [after(lt_linear(x, ws[i % copies])) for i in range(CALLS)])
        t_tr = (float("nan") if gated else  # its [N, M] output would need a transpose first
                graph_us(lambda: [torch.mm(ws[i % copies], x.t()) for i in range(CALLS)]))
        best = None
        for cfg in CONFIGS:
            if k % cfg[1]:
                continue
            try:
                err = (skinny(x, ws[0], cfg, gated).double() - ref).abs().max().item()
                if err > 0.05 * ref.abs().max().item():
                    print(f"  {name} m={m} {cfg}: wrong (max err {err:.3g})")
                    continue
                t = graph_us(lambda: [skinny(x, ws[i % copies], cfg, gated)
                                      for i in range(CALLS)])
            except Exception as exc:  # out of shared memory and the like
                print(f"  {name} m={m} {cfg}: failed ({type(exc).__name__})")
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        print(f"{name} | {m} | {t_blas:.1f} | {t_lt:.1f} | {t_tr:.1f} | {size / t_blas / 1e3:.0f} | "
              f"{best[0]:.1f} | "
              f"{size / best[0] / 1e3:.0f} | {best[1]}", flush=True)
    ws.clear()  # free this shape's copies before the next
