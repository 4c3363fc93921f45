"""How exact e4m3 tensor-core dots are: one 64 x 64 block of scores over head_dim 128 (GPU only).

Scores of e4m3 K taken with e4m3 dots (q rounded to e4m3 after a per-row power-of-two scale,
as a split of q into e4m3 pieces would) against the float64 product of the same e4m3 values,
with Triton's ``max_num_imprecise_acc`` (how many products the tensor cores sum before the sum
is added in fp32; 0: Triton's default for the dot), next to fp16 dots of the same values: the
largest error, and that over the largest sum of |products|, the scale the tensor cores align
to.
This is why the triton backend converts K/V to fp16 instead (docs/decisions.md).

Usage: ``python tools/fp8_dot_precision.py [--seed 0]``.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

M, N, D = 64, 64, 128


@triton.jit
def _scores(A, K, S, M: tl.constexpr, N: tl.constexpr, D: tl.constexpr, IMPRECISE: tl.constexpr):
    m, n, d = tl.arange(0, M), tl.arange(0, N), tl.arange(0, D)
    a = tl.load(A + m[:, None] * D + d[None, :])
    k = tl.load(K + n[:, None] * D + d[None, :])
    if IMPRECISE == 0:
        s = tl.dot(a, tl.trans(k))
    else:
        s = tl.dot(a, tl.trans(k), max_num_imprecise_acc=IMPRECISE)
    tl.store(S + m[:, None] * N + n[None, :], s)


def score_error(a: torch.Tensor, k: torch.Tensor, imprecise: int = 0) -> tuple[float, float]:
    """(largest |score - exact|, that over the largest sum of |products|) of ``a @ k.T``."""
    exact = a.double() @ k.double().T
    s = torch.empty(M, N, device="cuda")
    _scores[(1,)](a, k, s, M=M, N=N, D=D, IMPRECISE=imprecise, num_warps=4)
    err = float((s.double() - exact).abs().max())
    return err, err / float((a.double().abs() @ k.double().abs().T).max())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    q = torch.randn(M, D, device="cuda")
    k = (torch.randn(N, D, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    row_max = q.abs().amax(1, keepdim=True)
    a = (q * torch.exp2(7 - torch.floor(torch.log2(row_max)))).to(torch.float8_e4m3fn)
    print(f"largest |score|: {float((a.double() @ k.double().T).abs().max()):.3e}")
    print("| dot | max abs error | over the largest sum of abs products |")
    print("| --- | --- | --- |")
    for name, imprecise, dtype in [*((f"e4m3, max_num_imprecise_acc {i or 'default'}", i, None)
                                     for i in (0, 32, 64, 128)),
                                   ("fp16 (the same values)", 0, torch.float16)]:
        err, rel = score_error(a.to(dtype) if dtype else a, k.to(dtype) if dtype else k,
                               imprecise)
        print(f"| {name} | {err:.3e} | {rel:.2e} |")


if __name__ == "__main__":
    main()
