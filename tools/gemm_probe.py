"""Skinny matmuls of a decode step: cuBLAS (``F.linear``) against a Triton kernel.

For each Llama-3-8B projection (qkv, o, gate_up, down, LM head) and each row count, times 32
calls replayed as one CUDA graph, cycling through enough weight copies that every call reads
its weight from HBM, and prints µs per call and the weight's read bandwidth. The Triton
kernel streams ``BLOCK_N`` weight rows per program over the whole reduction (fp32
accumulation, rounded once), best of a few block shapes and pipeline depths.

Usage: python3 tools/gemm_probe.py   (GPU only)
"""
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
ROWS = [int(r) for r in sys.argv[1:]] or [1, 20]
CALLS = 32


@triton.jit
def _skinny(X, W, Y, M, N, K, stride_x, stride_w, stride_y,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(W + rn[:, None].to(tl.int64) * stride_w + rk[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty), mask=ok)


def skinny(x, w, cfg):
    bn, bk, stages, warps = cfg
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm = max(16, triton.next_power_of_2(m))
    _skinny[(triton.cdiv(n, bn),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_stages=stages,
                                   num_warps=warps)
    return y


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(g.replay, return_mode="median") * 1e3 / CALLS


CONFIGS = [c for c in itertools.product((32, 64, 128), (128, 256), (3, 5), (4,))
           if c[0] * c[1] <= 128 * 128]
dev, dt = "cuda", torch.bfloat16
print("shape | rows | cuBLAS µs | GB/s | best Triton µs | GB/s | config (BN, BK, stages, warps)")
for name, (n, k) in SHAPES.items():
    size = n * k * 2
    copies = max(2, -(-600_000_000 // size))
    ws = [torch.randn(n, k, device=dev, dtype=dt) / 64 for _ in range(copies)]
    for m in ROWS:
        x = torch.randn(m, k, device=dev, dtype=dt)
        ref = F.linear(x.double(), ws[0].double())
        t_blas = graph_us(lambda: [F.linear(x, ws[i % copies]) for i in range(CALLS)])
        best = None
        for cfg in CONFIGS:
            if k % cfg[1]:
                continue
            try:
                err = (skinny(x, ws[0], cfg).double() - ref).abs().max().item()
                if err > 0.05 * ref.abs().max().item():
                    print(f"  {name} m={m} {cfg}: wrong (max err {err:.3g})")
                    continue
                t = graph_us(lambda: [skinny(x, ws[i % copies], cfg) for i in range(CALLS)])
            except Exception as exc:  # out of shared memory and the like
                print(f"  {name} m={m} {cfg}: failed ({type(exc).__name__})")
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        print(f"{name} | {m} | {t_blas:.1f} | {size / t_blas / 1e3:.0f} | {best[0]:.1f} | "
              f"{size / best[0] / 1e3:.0f} | {best[1]}", flush=True)
    ws.clear()  # free this shape's copies before the next
