"""Warp-specialised partial attention in Gluon over a contiguous prompt, 16-bit or FP8 K/V.

The question it answers: would producer/consumer warp specialisation (which Triton 3.6 does not
apply to DeFT's partial loop) take the partial pass of a long shared prompt to HBM speed, and
FP8 K/V to twice that? Partial states of ``--tile``-token tiles of one ``--tokens`` prompt,
64 rows (16 queries x 4 GQA heads) per KV head, no mask, Llama-3-8B's 8 KV heads of 128, 32
layers replayed from a CUDA graph (no merge). Partitions: a loader warp (TMA of K/V blocks
into a ring), for FP8 converter warps (e4m3 -> fp16 into a second ring: ``wgmma`` takes its B
operand from shared memory; one warpgroup, two, or one each for K and V), and one or two
consumer warpgroups (q.kT and p.v on ``wgmma``, online softmax; two take alternate blocks into
two partial states, merged in the check). Each build's output is checked against float64.
Result and what it decided: docs/decisions.md ("Warp specialisation in Gluon, measured").

Usage: ``python tools/ws_partial_gluon.py [--tokens 32768] [--tile 1024] [--kv fp16,fp8]
[--consumers 1|2]`` (H200); ``--compile-only`` compiles every build for sm_90a on any machine
and prints ptxas's registers and spills (``tools/kernel_registers.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, even when run under the CPU test suite
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from deft.merge import merge_states  # noqa: E402

H_KV, M, D, LAYERS = 8, 64, 128, 32
# Builds over 16-bit and FP8 K/V: converter registers, register cap, ring stages, block tokens,
# consumers (two take alternate blocks: with an even ring each has slots of its own).
CONFIGS = [dict(conv_regs=64), dict(conv_regs=88, maxnreg=128), dict(conv_regs=64, stages=2),
           dict(conv_regs=64, stages=4), dict(conv_regs=64, block_n=32, stages=4),
           dict(conv_regs=64, maxnreg=128, consumers=2, cons_regs=168, stages=4)]
# Over FP8 only: two consumers sharing a ring of 3 slots, where a consumer may wait by parity
# on a slot whose earlier load has not landed, a phase parity cannot tell from its own (over
# 16-bit K/V, whose TMA loads land in any order, the build failed on the H200 with an
# unspecified launch failure, likely so; FP8's converter hands blocks over in order); a
# converter of 8 warps; one converter warpgroup each for K and V. The cap keeps 416 threads
# within the register file.
FP8_CONFIGS = [dict(conv_regs=64, maxnreg=128, consumers=2, cons_regs=168),
               dict(conv_regs=64, maxnreg=128, conv_warps=8),
               dict(conv_regs=64, maxnreg=128, split_conv=True)]


def builds(fp8: bool) -> list[dict]:
    """The builds the tool runs over 16-bit (``fp8=False``) or FP8 K/V."""
    return CONFIGS + (FP8_CONFIGS if fp8 else [])


@gluon.jit
def _loader(k_desc, v_desc, q_smem, k8, v8, k16, v16, bars, tok0, col, qk_scale, PO, PLSE,
            out_row, nblk):
    # Worker partitions get their arguments as values: sizes come from the buffers' types.
    BLOCK_N: gl.constexpr = k16.type.shape[1]
    CONVERT: gl.constexpr = k8.dtype != k16.dtype
    f8_empty, f8_ready, k16_empty, k16_ready, v16_empty, v16_ready = bars
    S: gl.constexpr = k8.type.shape[0]
    for i in range(nblk):
        idx = i % S
        ph = (i // S) & 1
        if CONVERT:
            mbarrier.wait(f8_empty.index(idx), ph ^ 1)
            bar = f8_ready.index(idx)
            mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [tok0 + i * BLOCK_N, col], bar, k8.index(idx))
            tma.async_copy_global_to_shared(v_desc, [tok0 + i * BLOCK_N, col], bar, v8.index(idx))
        else:
            mbarrier.wait(k16_empty.index(idx), ph ^ 1)
            mbarrier.expect(k16_ready.index(idx), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [tok0 + i * BLOCK_N, col],
                                            k16_ready.index(idx), k16.index(idx))
            mbarrier.wait(v16_empty.index(idx), ph ^ 1)
            mbarrier.expect(v16_ready.index(idx), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [tok0 + i * BLOCK_N, col],
                                            v16_ready.index(idx), v16.index(idx))


@gluon.jit
def _convert(k8, v8, k16, v16, bars, nblk, DO_K: gl.constexpr, DO_V: gl.constexpr):
    """e4m3 -> fp16 of K, V or both of each block, from the one-byte ring into the 16-bit one."""
    f8_empty, f8_ready, k16_empty, k16_ready, v16_empty, v16_ready = bars
    S: gl.constexpr = k8.type.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])
    for i in range(nblk):
        idx = i % S
        ph = (i // S) & 1
        mbarrier.wait(f8_ready.index(idx), ph)
        if DO_K:
            k = k8.index(idx).load(layout).to(gl.float16)
        if DO_V:
            v = v8.index(idx).load(layout).to(gl.float16)
        fence_async_shared()  # our generic loads before the next TMA write
        mbarrier.arrive(f8_empty.index(idx), count=1)
        if DO_K:
            mbarrier.wait(k16_empty.index(idx), ph ^ 1)
            k16.index(idx).store(k)
            fence_async_shared()  # our generic stores before the consumer's wgmma
            mbarrier.arrive(k16_ready.index(idx), count=1)
        if DO_V:
            mbarrier.wait(v16_empty.index(idx), ph ^ 1)
            v16.index(idx).store(v)
            fence_async_shared()
            mbarrier.arrive(v16_ready.index(idx), count=1)


@gluon.jit
def _converter(k_desc, v_desc, q_smem, k8, v8, k16, v16, bars, tok0, col, qk_scale, PO, PLSE,
               out_row, nblk):
    if k8.dtype != k16.dtype:
        _convert(k8, v8, k16, v16, bars, nblk, True, True)


@gluon.jit
def _k_converter(k_desc, v_desc, q_smem, k8, v8, k16, v16, bars, tok0, col, qk_scale, PO,
                 PLSE, out_row, nblk):
    _convert(k8, v8, k16, v16, bars, nblk, True, False)


@gluon.jit
def _v_converter(k_desc, v_desc, q_smem, k8, v8, k16, v16, bars, tok0, col, qk_scale, PO,
                 PLSE, out_row, nblk):
    _convert(k8, v8, k16, v16, bars, nblk, False, True)


@gluon.jit
def _second_consumer(k_desc, v_desc, q_smem, k8, v8, k16, v16, bars, tok0, col, qk_scale, PO,
                     PLSE, out_row, nblk):
    """The odd blocks, into the partial state after the first consumer's."""
    _consumer(q_smem, k16, v16, bars, qk_scale, PO, PLSE, out_row + q_smem.type.shape[0], 1, 2,
              nblk)


@gluon.jit
def _consumer(q_smem, k16, v16, bars, qk_scale, PO, PLSE, out_row, first, step, nblk):
    """Blocks first, first + step, ...: one partial state at out_row."""
    M: gl.constexpr = q_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k16.type.shape[1]
    D: gl.constexpr = k16.type.shape[2]
    f8_empty, f8_ready, k16_empty, k16_ready, v16_empty, v16_ready = bars
    S: gl.constexpr = k16.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    m_i = gl.full([M], -1.0e30, gl.float32, row_s)
    l_i = gl.zeros([M], gl.float32, row_s)
    acc = gl.zeros([M, D], gl.float32, o_layout)
    zero_s = gl.zeros([M, BLOCK_N], gl.float32, s_layout)
    for i in range(first, nblk, step):
        idx = i % S
        ph = (i // S) & 1
        mbarrier.wait(k16_ready.index(idx), ph)
        s = warpgroup_mma(q_smem, k16.index(idx).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        mbarrier.arrive(k16_empty.index(idx), count=1)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p16 = gl.convert_layout(p.to(gl.float16), p_layout)
        mbarrier.wait(v16_ready.index(idx), ph)
        acc = warpgroup_mma(p16, v16.index(idx), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(v16_empty.index(idx), count=1)
    l_o = gl.convert_layout(l_i, row_o)
    o = acc / gl.expand_dims(l_o, 1)
    rows = gl.arange(0, M, row_o)
    cols = gl.arange(0, D, gl.SliceLayout(0, o_layout))
    offs = (out_row + gl.expand_dims(rows, 1)) * D + gl.expand_dims(cols, 0)
    gl.store(PO + offs, o.to(PO.dtype.element_ty))
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(PLSE + out_row + gl.arange(0, M, row_s), lse)


@gluon.jit
def ws_partial_kernel(Q, k_desc, v_desc, PO, PLSE, qk_scale, H_KV,
                      M: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                      TILE: gl.constexpr, STAGES: gl.constexpr, CONVERT: gl.constexpr,
                      CONV_REGS: gl.constexpr, CONV_WARPS: gl.constexpr, SPLIT_CONV: gl.constexpr,
                      CONSUMERS: gl.constexpr, CONS_REGS: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    tile = pid // H_KV
    kvh = pid % H_KV
    tok0 = tile * TILE
    col = kvh * D
    NBLK: gl.constexpr = TILE // BLOCK_N
    # q [H_KV, M, D] fp16, into shared memory once
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, M, gl.SliceLayout(1, q_layout))
    c = gl.arange(0, D, gl.SliceLayout(0, q_layout))
    q = gl.load(Q + (kvh * M + gl.expand_dims(r, 1)) * D + gl.expand_dims(c, 0))
    q_smem = gl.allocate_shared_memory(gl.float16, [M, D],
                                       gl.NVMMASharedLayout.get_default_for([M, D], gl.float16), q)
    l16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.float16)
    k16 = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, D], l16)
    v16 = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, D], l16)
    if CONVERT:
        k8 = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v8 = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    else:
        k8 = k16
        v8 = v16
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    f8_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bl)
    f8_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bl)
    k16_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bl)
    k16_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bl)
    v16_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bl)
    v16_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bl)
    for i in gl.static_range(STAGES):
        mbarrier.init(f8_empty.index(i), count=2 if SPLIT_CONV else 1)
        mbarrier.init(f8_ready.index(i), count=1)
        mbarrier.init(k16_empty.index(i), count=1)
        mbarrier.init(k16_ready.index(i), count=1)
        mbarrier.init(v16_empty.index(i), count=1)
        mbarrier.init(v16_ready.index(i), count=1)
    fence_async_shared()
    bars = (f8_empty, f8_ready, k16_empty, k16_ready, v16_empty, v16_ready)
    out_row = pid * CONSUMERS * M
    common = (k_desc, v_desc, q_smem, k8, v8, k16, v16, bars, tok0, col, qk_scale, PO, PLSE,
              out_row, NBLK)
    if SPLIT_CONV:
        gl.warp_specialize([
            (_consumer, (q_smem, k16, v16, bars, qk_scale, PO, PLSE, out_row, 0, 1, NBLK)),
            (_loader, common), (_k_converter, common), (_v_converter, common),
        ], [1, CONV_WARPS, CONV_WARPS], [24, CONV_REGS, CONV_REGS])
    elif CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (q_smem, k16, v16, bars, qk_scale, PO, PLSE, out_row, 0, 1, NBLK)),
            (_loader, common), (_converter, common),
        ], [1, CONV_WARPS], [24, CONV_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, k16, v16, bars, qk_scale, PO, PLSE, out_row, 0, 2, NBLK)),
            (_loader, common), (_converter, common), (_second_consumer, common),
        ], [1, 4, 4], [24, CONV_REGS, CONS_REGS])


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, po: torch.Tensor,
           plse: torch.Tensor, tile: int, block_n: int = 64, stages: int = 3,
           conv_regs: int = 64, maxnreg: int | None = None, consumers: int = 1,
           cons_regs: int = 168, conv_warps: int = 4, split_conv: bool = False,
           compile_only: bool = False) -> object:
    """Partial states of ``q [H_kv, M, D]`` (fp16) over ``k, v [N, H_kv * D]`` (fp16 or
    e4m3, raw values) into ``po [tiles * H_kv * consumers * M, D]`` and ``plse``."""
    h_kv, m, d = q.shape
    fp8 = k.dtype == torch.float8_e4m3fn
    if not fp8 and (stages % consumers or conv_warps != 4 or split_conv):
        raise ValueError("over 16-bit K/V: no converter variants, and the consumers must "
                         "divide the stages")
    layout = gl.NVMMASharedLayout.get_default_for([block_n, d],
                                                  gl.float8e4nv if fp8 else gl.float16)
    kd = TensorDescriptor(k, list(k.shape), list(k.stride()), [block_n, d], layout)
    vd = TensorDescriptor(v, list(v.shape), list(v.stride()), [block_n, d], layout)
    grid = (k.shape[0] // tile * h_kv,)
    args = (q, kd, vd, po, plse, d**-0.5 * math.log2(math.e), h_kv)
    kw = dict(M=m, D=d, BLOCK_N=block_n, TILE=tile, STAGES=stages, CONVERT=fp8,
              CONV_REGS=conv_regs, CONV_WARPS=conv_warps, SPLIT_CONV=split_conv,
              CONSUMERS=consumers, CONS_REGS=cons_regs, num_warps=4)
    if maxnreg:
        kw["maxnreg"] = maxnreg
    if compile_only:
        return ws_partial_kernel.warmup(*args, grid=grid, **kw)
    return ws_partial_kernel[grid](*args, **kw)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tile's partial state in float64: ``[tiles * H_kv * M, D]`` and its lse."""
    h_kv, m, d = q.shape
    n = k.shape[0]
    kk = k.double().view(n // tile, tile, h_kv, d)
    vv = v.double().view(n // tile, tile, h_kv, d)
    s = torch.einsum("hmd,tnhd->thmn", q.double(), kk) * d**-0.5
    o = torch.einsum("thmn,tnhd->thmd", torch.softmax(s, -1), vv)
    return o.reshape(-1, d), torch.logsumexp(s, -1).reshape(-1)


def merged(po: torch.Tensor, plse: torch.Tensor, consumers: int) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """The consumers' partial states of each (tile, KV head) merged into one, in float64."""
    o, lse = merge_states(po.double().view(-1, consumers, M, D),
                          plse.double().view(-1, consumers, M))
    return o.reshape(-1, D), lse.reshape(-1)


def _compile_all() -> None:
    from kernel_registers import _Sm90, ptxas_usage
    from triton.runtime import driver

    driver.set_active(_Sm90())
    for kv_dtype in (torch.float16, torch.float8_e4m3fn):
        for cfg in builds(kv_dtype != torch.float16):
            q = torch.empty(H_KV, M, D, dtype=torch.float16)
            k = torch.empty(1024, H_KV * D, dtype=kv_dtype)
            po = torch.empty(2 * H_KV * M, D)
            plse = torch.empty(2 * H_KV * M)
            built = launch(q, k, k, po, plse, 1024, compile_only=True, **cfg)
            print(kv_dtype, cfg, ptxas_usage(built.asm["ptx"], cfg.get("maxnreg")), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--tile", type=int, default=1024)
    ap.add_argument("--kv", default="fp16,fp8", help="comma-separated: fp16, fp8")
    ap.add_argument("--consumers", type=int, choices=(1, 2), help="only builds with this many")
    args = ap.parse_args()
    if args.compile_only:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        _compile_all()
        return
    from benchmarks.attention_gpu import fp8_copy

    torch.manual_seed(0)
    n, tile = args.tokens, args.tile
    q = torch.randn(H_KV, M, D, device="cuda", dtype=torch.float16)
    print("| K/V | build | µs per 32-layer step | µs per layer | max abs err o / lse |")
    print("| --- | --- | --- | --- | --- |")
    for kv in args.kv.split(","):
        ks, vs = [], []
        for _ in range(LAYERS):
            k = torch.randn(n, H_KV, D, device="cuda", dtype=torch.float16)
            v = torch.randn(n, H_KV, D, device="cuda", dtype=torch.float16)
            if kv == "fp8":
                k, v = fp8_copy(k)[0], fp8_copy(v)[0]
            ks.append(k.view(n, H_KV * D))
            vs.append(v.view(n, H_KV * D))
        ref_o, ref_lse = reference(q, ks[0].view(n, H_KV, D), vs[0].view(n, H_KV, D), tile)
        for cfg in builds(kv == "fp8"):
            c = cfg.get("consumers", 1)
            if args.consumers and c != args.consumers:
                continue
            po = torch.empty(c * n // tile * H_KV * M, D, device="cuda")
            plse = torch.empty(c * n // tile * H_KV * M, device="cuda")
            launch(q, ks[0], vs[0], po, plse, tile, **cfg)
            o, lse = merged(po, plse, c)
            err = (f"{float((o - ref_o).abs().max()):.2e} / "
                   f"{float((lse - ref_lse).abs().max()):.2e}")

            def step(cfg: dict = cfg, po: torch.Tensor = po, plse: torch.Tensor = plse) -> None:
                for layer in range(LAYERS):
                    launch(q, ks[layer], vs[layer], po, plse, tile, **cfg)

            step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            us = triton.testing.do_bench(graph.replay, return_mode="median") * 1e3
            print(f"| {kv} | {cfg} | {us:,.0f} | {us / LAYERS:.1f} | {err} |", flush=True)


if __name__ == "__main__":
    main()
