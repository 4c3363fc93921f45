"""Partial states of few-row work items with the product turned around (a spike, not shipped).

The question it answers: a branch's own tokens are seen by one query's query heads (4 rows of
the Llama-3-8B shape), which the shipped kernel runs in a 64-row block: 60 of its 64 score
rows and accumulator rows are padding, and the loop's softmax and rescale work, which paces
it, is spent on them. Turned around, the block's long side is the tokens: ``sᵀ = k·qᵀ``
(``[BLOCK_N tokens, ROWS]``, ``wgmma`` with M = tokens and N = ``ROWS`` = 16) and ``oᵀ +=
vᵀ·p`` (``[D, ROWS]``), so a block of 64 tokens costs a 64 x 16 softmax and a 128 x 16
rescale instead of 64 x 64 and 64 x 128. The softmax then reduces across the token axis,
which spans the warps.

It times, replayed from a CUDA graph over 32 layers (bf16, Llama-3-8B attention: 32 query
heads, 8 KV heads, head_dim 128), one program per (query, KV head) streaming its branch:
- the shipped ``TreeAttention.run`` on the branches alone (each a root of its own), one plan
  and graph-safe, and on the whole few-shot tree and its prompt alone, for scale;
- this kernel turned around (``swap``) and the same loop in the usual orientation with 16-row
  blocks (``rows16``: ``mma.sync``), over the same slots.
Both are checked against the float64 reference first. No isolation of non-finite K/V (a
bound on what the orientation saves, not a kernel the contract allows as is).

Usage: ``python tools/few_rows_swap.py [--kv bf16|fp8] [--prompt 4000] [--branches 20]
[--branch-len 200]`` (GPU; ``fp8``: e4m3 K/V with per-head scales, converted to fp16 in
registers for both products, q in fp16, as the shipped kernel's ``F16_DOTS``); ``--check``
runs the correctness check alone (the Triton interpreter on a CPU works, with a tiny shape:
``TRITON_INTERPRET=1 python tools/few_rows_swap.py --check --tiny``);
``--compile-only`` compiles each build for sm_90a on any machine and prints its registers,
spills and instructions per K/V block loop (``tools/kernel_registers.py``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--compile-only" in sys.argv:  # Triton reads the flag as it loads a kernel's source
    os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from deft import TreeAttention, TreeLayout  # noqa: E402
from deft.cache.pool import FP8, quantize  # noqa: E402
from deft.ops.base import Capacity  # noqa: E402
from deft.ops.reference import reference_attention  # noqa: E402
from benchmarks.attention_gpu import time_us  # noqa: E402
from benchmarks.trees import few_shot_layout  # noqa: E402

LAYERS = 32


@triton.jit
def _program(starts, ends, scale, k_scale, G: tl.constexpr, ROWS: tl.constexpr,
             FP8: tl.constexpr):
    """This program's (query, KV head): the KV head, the query's token range, the score
    scale in log2 units (an FP8 head's K scale folded in; its V scale goes into the output),
    the ``ROWS`` query rows' indices and which of them are real."""
    qi, h = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(starts + qi), tl.load(ends + qi)
    if FP8:
        scale = scale * tl.load(k_scale + h)
    r = tl.arange(0, ROWS)
    row = qi * tl.num_programs(1) * G + h * G + r
    return h, start, end, scale * 1.4426950408889634, row, r < G


@triton.jit
def _block(t0, end, h, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """The K/V block at token ``t0``: which of its tokens are the query's, and their rows'
    offsets in ``[tokens, KV heads, D]`` K/V."""
    t = t0 + tl.arange(0, BLOCK_N)
    off = (t * tl.num_programs(1) + h)[:, None] * D + tl.arange(0, D)[None, :]
    return t < end, off


@triton.jit
def _swap_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, starts, ends, scale, k_scale, v_scale,
                 G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 FP8: tl.constexpr):
    """One (query, KV head): ``sᵀ = k·qᵀ`` and ``oᵀ += vᵀ·p`` over the query's tokens."""
    h, start, end, scale, row, live = _program(starts, ends, scale, k_scale, G, ROWS, FP8)
    d = tl.arange(0, D)
    q_t = tl.load(q_ptr + row[None, :] * D + d[:, None], mask=live[None, :], other=0.0)  # [D, ROWS]
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([D, ROWS], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        seen, kv_off = _block(t0, end, h, BLOCK_N, D)
        k = tl.load(k_ptr + kv_off, mask=seen[:, None], other=0.0).to(q_t.dtype)
        s = tl.dot(k, q_t) * scale  # [BLOCK_N, ROWS], log2 units
        s = tl.where(seen[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp2(s - m_new[None, :])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        v = tl.load(v_ptr + kv_off, mask=seen[:, None], other=0.0).to(q_t.dtype)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(v.dtype))
        m = m_new
    o = acc / l_sum[None, :]
    if FP8:
        o = o * tl.load(v_scale + h)
    tl.store(o_ptr + row[None, :] * D + d[:, None],
             o.to(o_ptr.dtype.element_ty), mask=live[None, :])
    tl.store(lse_ptr + row, m / 1.4426950408889634 + tl.log(l_sum), mask=live)


@triton.jit
def _rows_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, starts, ends, scale, k_scale, v_scale,
                 G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 FP8: tl.constexpr):
    """The same in the usual orientation: ``s = q·kᵀ`` (``[ROWS, BLOCK_N]``), ``o += p·v``."""
    h, start, end, scale, row, live = _program(starts, ends, scale, k_scale, G, ROWS, FP8)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + row[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        seen, kv_off = _block(t0, end, h, BLOCK_N, D)
        k = tl.load(k_ptr + kv_off, mask=seen[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=seen[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    o = acc / l_sum[:, None]
    if FP8:
        o = o * tl.load(v_scale + h)
    tl.store(o_ptr + row[:, None] * D + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(lse_ptr + row, m / 1.4426950408889634 + tl.log(l_sum), mask=live)


KERNELS = {"swap": _swap_kernel, "rows16": _rows_kernel}


def branches_layout(branches: int, branch_len: int) -> TreeLayout:
    """``branches`` roots of ``branch_len`` tokens, one query each (its newest token)."""
    return TreeLayout.from_node_lengths([-1] * branches, [branch_len] * branches,
                                        list(range(branches)))


def launcher(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
             ends: torch.Tensor, block_n: int, warps: int, stages: int,
             scales: tuple[torch.Tensor, torch.Tensor] | None = None):
    """A closure launching ``kind`` over every (query, KV head), over FP8 K/V with their
    per-head ``scales``; returns ``(run, o, lse)``."""
    n_q, h_q, d = q.shape
    h_kv = k.shape[1]
    o, lse = torch.empty_like(q), torch.empty(n_q, h_q, device=q.device, dtype=torch.float32)

    def run() -> None:
        ks, vs = scales if scales is not None else (lse, lse)
        KERNELS[kind][(n_q, h_kv)](q, k, v, o, lse, starts, ends, d**-0.5, ks, vs,
                                   G=h_q // h_kv, D=d, ROWS=16, BLOCK_N=block_n,
                                   FP8=scales is not None, num_warps=warps, num_stages=stages)
    return run, o, lse


def graph_us(layer) -> float:  # noqa: ANN001
    """Median µs of ``LAYERS`` calls of ``layer`` captured in one CUDA graph and replayed."""
    return time_us(lambda: [layer() for _ in range(LAYERS)], graph=True)


def builds(check: bool) -> list[tuple[str, int, int, int]]:
    """(kernel, tokens per block, warps, stages) of each build timed (or checked)."""
    if check:
        return [("swap", 64, 4, 2), ("rows16", 32, 4, 2)]
    return [("swap", 32, 4, 2), ("swap", 64, 4, 2), ("swap", 64, 4, 3), ("rows16", 32, 4, 2),
            ("rows16", 32, 4, 3), ("rows16", 64, 4, 2)]


def compile_only() -> None:
    """Each build for sm_90a, no GPU: ptxas's registers and spills, the loop's instructions."""
    import subprocess
    import tempfile

    from triton.runtime import driver

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kernel_registers as kr

    driver.set_active(kr._Sm90())
    lse, se, hs = torch.empty(4, 32), torch.empty(4, dtype=torch.int32), torch.empty(8)
    for (kind, bn, w, st), fp8 in itertools.product(builds(False), (False, True)):
        q = torch.empty(4, 32, 128, dtype=torch.float16 if fp8 else torch.bfloat16)
        kv = torch.empty(256, 8, 128, dtype=FP8 if fp8 else torch.bfloat16)
        c = KERNELS[kind].warmup(q, kv, kv, q, lse, se, se, 0.1, hs, hs, G=4, D=128, ROWS=16,
                                 BLOCK_N=bn, FP8=fp8, grid=(1,), num_warps=w, num_stages=st)
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            cubin.write_bytes(c.asm["cubin"])
            sass = subprocess.run([str(kr.PTXAS.parent / "nvdisasm"), "-c", "-g", str(cubin)],
                                  capture_output=True, text=True, check=True).stdout
        usage = kr.ptxas_usage(c.asm["ptx"], None, sass)
        print(f"{kind} n{bn} w{w} s{st} {'fp8' if fp8 else 'bf16'}", usage, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=4000)
    ap.add_argument("--branches", type=int, default=20)
    ap.add_argument("--branch-len", type=int, default=200)
    ap.add_argument("--check", action="store_true", help="only check against the reference")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (2 KV heads, head_dim 32)")
    ap.add_argument("--kv", choices=("bf16", "fp8"), default="bf16",
                    help="K/V format (fp8: e4m3 with per-head scales, converted to fp16 for "
                    "the products, q in fp16)")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile each build for sm_90a (no GPU) and print its usage")
    args = ap.parse_args(argv)
    if args.compile_only:
        return compile_only()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h_q, h_kv, d = (8, 2, 32) if args.tiny else (32, 8, 128)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    layout = branches_layout(args.branches, args.branch_len)
    n_tok = args.branches * args.branch_len
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(args.branches, h_q, d, generator=g).to(dev, dtype)
    k = torch.randn(n_tok, h_kv, d, generator=g).to(dev, dtype)
    v = torch.randn(n_tok, h_kv, d, generator=g).to(dev, dtype)
    starts = torch.arange(0, n_tok, args.branch_len, dtype=torch.int32, device=dev)
    ends = starts + args.branch_len
    scales = None
    if args.kv == "fp8":
        scales = tuple(torch.rand(h_kv, generator=g).to(dev) * 0.02 + 0.005 for _ in range(2))
        k, v = quantize(k * 3, scales[0], FP8), quantize(v * 3, scales[1], FP8)
        q = q.to(torch.float16)
        ref_o, ref_lse = reference_attention(q, k.float() * scales[0][:, None],
                                             v.float() * scales[1][:, None], layout, d**-0.5)
    else:
        ref_o, ref_lse = reference_attention(q, k, v, layout, d**-0.5)
    rows = []
    for kind, bn, w, st in builds(args.check):
        run, o, lse = launcher(kind, q, k, v, starts, ends, bn, w, st, scales)
        run()
        err = float((o.double() - ref_o.to(o.device)).abs().max() / ref_o.abs().max())
        lse_err = float((lse.double() - ref_lse.to(o.device)).abs().max())
        assert err < 1e-2 and lse_err < 1e-3, (kind, bn, err, lse_err)
        us = None if args.check else graph_us(run)
        rows.append((f"{kind} n{bn} w{w} s{st}", us, err))
        print(rows[-1], flush=True)
    if args.check:
        return
    whole = few_shot_layout(args.prompt, args.branches, args.branch_len)
    for label, lay in (("branches alone", layout),
                       ("prompt alone", few_shot_layout(args.prompt, args.branches, 1)),
                       ("whole tree", whole)):
        n = int(lay.kv_indices.max()) + 1
        qq = torch.randn(lay.num_queries, h_q, d, device=dev, dtype=dtype)
        kk, vv = (torch.randn(n, h_kv, d, device=dev, dtype=dtype) for _ in range(2))
        given = {}
        if scales is not None:
            kk, vv = quantize(kk, scales[0], FP8), quantize(vv, scales[1], FP8)
            given = dict(k_scale=scales[0], v_scale=scales[1])
        for mode, cap in (("one plan", None), ("graph-safe", Capacity(lay.num_queries, n))):
            attn = TreeAttention(h_q, h_kv, d, backend="triton", device=dev, capacity=cap)
            attn.plan(lay, FP8 if scales is not None else None)
            out = torch.empty_like(qq)
            us = graph_us(lambda: attn.run(qq, kk, vv, out=out, **given))
            rows.append((f"shipped {mode}, {label}", us, None))
            print(rows[-1], flush=True)
    print(f"\nµs per {LAYERS}-layer step, graph replay, {args.kv} K/V; {args.branches} "
          f"branches of {args.branch_len} tokens, prompt {args.prompt}")
    for label, us, _ in rows:
        print(f"{label:40s} {us:9.1f}")


if __name__ == "__main__":
    main()
