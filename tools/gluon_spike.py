"""Spike: DeFT-Flatten's partial kernel with explicit asynchronous wgmma (Gluon), to measure
what the Triton kernel's serial loop costs (GPU only, sm_90).

The kernel covers what the bulk of a tree needs: tiles of consecutive slots loaded by TMA,
every query of the group seeing every token (``mask_from == tok1``), queries in plan order.
Each step issues the next block's ``Q·Kᵀ`` and the current block's ``P·V`` together and
runs the softmax of the next block while ``P·V`` is on the tensor cores (FlashAttention-3's
in-warpgroup overlap); K and V blocks come through a ring of ``STAGES`` TMA buffers.

It runs on trees whose tiles need no mask (``SPIKE_TREES``: queries at the end of one
shared node), checks layer 0's output against the float64 reference, and times the 32-layer
step (CUDA graph, µs per layer) against the shipped Triton kernels, both writing fp32
partial states and merged by the shipped merge kernel. Results: docs/benchmarks.md.

Usage: [BM=64] [BN=32] [STAGES=3] python3 tools/gluon_spike.py   (BM / 16 warps: one warp
group per 64 query rows; BN tokens per K/V block; STAGES K/V buffers in the ring)
"""
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M, BLOCK_N = int(os.environ.get("BM", 64)), int(os.environ.get("BN", 32))
STAGES, WARPS = int(os.environ.get("STAGES", 3)), int(os.environ.get("BM", 64)) // 16


@gluon.jit
def _scores_softmax(s, start, end, m_i, l_i, qk_scale, BLOCK_N: gl.constexpr,
                    S_LAYOUT: gl.constexpr):
    """Online-softmax step of one block of scores: tokens from ``end`` on do not count."""
    offs = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    s = gl.where(gl.expand_dims(offs < end, 0), s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _rows(row0, qs, qe, kvh, G: gl.constexpr, BLOCK_M: gl.constexpr, LAYOUT: gl.constexpr):
    """The work item's rows in the row layout of ``LAYOUT``: whether each exists, its query's
    plan position and its query head."""
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
    return rows < (qe - qs) * G, (qs + rows // G).to(gl.int64), kvh * G + rows % G


@gluon.jit
def _issue_loads(desc_k, desc_v, k_smem, v_smem, k_bar, v_bar, block, n, slot0, kvh,
                 BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """TMA copies of block ``block``'s K and V into its ring stage (none past ``n``)."""
    stage = block % STAGES
    ok = block < n
    row = slot0 + block * BLOCK_N
    mbarrier.expect(k_bar.index(stage), desc_k.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(desc_k, [row, kvh * D], k_bar.index(stage), k_smem.index(stage),
                                    pred=ok)
    mbarrier.expect(v_bar.index(stage), desc_v.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(desc_v, [row, kvh * D], v_bar.index(stage), v_smem.index(stage),
                                    pred=ok)


@gluon.jit
def gluon_partial_kernel(
    Q, desc_k, desc_v, PO, PLSE, work, qk_scale,
    stride_qn, stride_qh, stride_pn, stride_ph, stride_ln,
    G: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, Q_SMEM: gl.constexpr, num_warps: gl.constexpr,
):
    w = gl.program_id(0)
    kvh = gl.program_id(1)
    desc = work + w * 8
    tok0 = gl.load(desc)
    qs = gl.load(desc + 2)
    qe = gl.load(desc + 3)
    p0 = gl.load(desc + 4)
    end = gl.load(desc + 5)  # mask_from: the spike's trees see every token before it
    slot0 = gl.load(desc + 6)
    row0 = gl.load(desc + 7)

    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    # Q rows (query, GQA head) of this work item, into shared memory for the wgmma.
    row_ok, qpos, head = _rows(row0, qs, qe, kvh, G=G, BLOCK_M=BLOCK_M, LAYOUT=LOAD)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    q_ptrs = Q + gl.expand_dims(qpos * stride_qn + head * stride_qh, 1) + gl.expand_dims(d, 0)
    q = gl.load(q_ptrs, mask=gl.expand_dims(row_ok, 1), other=0.0)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BLOCK_M, D], Q_SMEM, q)

    k_smem = gl.allocate_shared_memory(desc_k.dtype, [STAGES, BLOCK_N, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(desc_v.dtype, [STAGES, BLOCK_N, D], desc_v.layout)
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()

    n = (end - tok0 + BLOCK_N - 1) // BLOCK_N
    for i in gl.static_range(STAGES):
        _issue_loads(desc_k, desc_v, k_smem, v_smem, k_bar, v_bar, i, n, slot0, kvh,
                     BLOCK_N=BLOCK_N, D=D, STAGES=STAGES)

    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=O_LAYOUT)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_LAYOUT)

    # Block 0's scores and softmax; then each step j overlaps block j's scores and block
    # j-1's P·V on the tensor cores with block j's softmax.
    mbarrier.wait(k_bar.index(0), 0, pred=n > 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    p, alpha, m_i, l_i = _scores_softmax(s, tok0, end, m_i, l_i, qk_scale, BLOCK_N=BLOCK_N,
                                         S_LAYOUT=S_LAYOUT)
    for j in range(1, n):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_bar.index(stage), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        mbarrier.wait(v_bar.index(prev), ((j - 1) // STAGES) & 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
        p_op = gl.convert_layout(p.to(desc_v.dtype), P_LAYOUT)
        acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        p, alpha, m_i, l_i = _scores_softmax(s, tok0 + j * BLOCK_N, end, m_i, l_i, qk_scale,
                                             BLOCK_N=BLOCK_N, S_LAYOUT=S_LAYOUT)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        # Block j-1's stage is free (its Q·Kᵀ and P·V are done): refill it.
        _issue_loads(desc_k, desc_v, k_smem, v_smem, k_bar, v_bar, j - 1 + STAGES, n, slot0, kvh,
                     BLOCK_N=BLOCK_N, D=D, STAGES=STAGES)
    last = gl.maximum(n - 1, 0) % STAGES
    mbarrier.wait(v_bar.index(last), ((n - 1) // STAGES) & 1, pred=n > 0)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
    acc_tok = warpgroup_mma(gl.convert_layout(p.to(desc_v.dtype), P_LAYOUT), v_smem.index(last),
                            acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_LAYOUT))
    has = l_o > 0
    o = acc / gl.expand_dims(gl.where(has, l_o, 1.0), 1)
    lse = gl.where(has, (m_o + gl.log2(gl.where(has, l_o, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    ok_o, qpos_o, head_o = _rows(row0, qs, qe, kvh, G=G, BLOCK_M=BLOCK_M, LAYOUT=O_LAYOUT)
    pid = p0 + qpos_o - qs  # the query's partial state: p0 + its index in the group
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, O_LAYOUT))
    po_ptrs = PO + gl.expand_dims(pid * stride_pn + head_o * stride_ph, 1) + gl.expand_dims(d_o, 0)
    gl.store(po_ptrs, o.to(PO.dtype.element_ty), mask=gl.expand_dims(ok_o, 1))
    gl.store(PLSE + pid * stride_ln + head_o, lse, mask=ok_o)


def _shared_node(tokens: int, queries: int):
    """One node of ``tokens`` tokens with ``queries`` queries that all see all of it."""
    from deft import TreeLayout

    return TreeLayout.from_node_lengths([-1], [tokens], [0] * queries)


SPIKE_TREES = {
    "32 queries on 2,000 tokens": (2000, 32),
    "256 queries on 2,000 tokens": (2000, 256),
    "20 queries on 4,000 tokens": (4000, 20),
    "64 queries on 20,000 tokens": (20000, 64),
    "4 queries on 20,000 tokens": (20000, 4),
}


def _launch_gluon(attn, q, k, v, out) -> None:
    """The step's partial states by the Gluon kernel, merged by the shipped merge launch."""
    from deft.ops import triton_backend as tb

    prep = attn._prepared
    nq, h_q, d = q.shape
    h_kv = k.shape[1]
    po, plse, lse = prep.workspaces
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], gl.bfloat16)
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, d], gl.bfloat16)
    descs = [TensorDescriptor(c.view(c.shape[0], h_kv * d), [c.shape[0], h_kv * d], [h_kv * d, 1],
                              [BLOCK_N, d], kv_layout) for c in (k, v)]
    gluon_partial_kernel[(prep.num_work, h_kv)](
        q, *descs, po, plse, prep.segment("work"), d**-0.5 * 1.4426950408889634,
        q.stride(0), q.stride(1), h_q * d, d, h_q,
        G=h_q // h_kv, D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, Q_SMEM=q_layout,
        num_warps=WARPS)
    cfg = prep.config  # fp32 partials: the base config's merge shape
    tb.launch_merge(po, plse, out, lse, prep.arrays[1], prep.arrays[2], False, cfg.merge_block,
                    cfg.merge_warps, strides=(h_q * d, d, h_q))


def main() -> None:
    import dataclasses

    from deft import TreeAttention
    from deft.bench.gpu_bench import D, DTYPE, H_KV, H_Q, LAYERS, _time
    from deft.ops import triton_backend as tb
    from deft.ops.reference import reference_attention

    # fp32 partial states everywhere (the spike writes fp32), both regimes.
    base = tb._GPU_CONFIGS[D]
    tb._GPU_CONFIGS[D] = dataclasses.replace(base, wide=None)
    print(f"BLOCK_M={BLOCK_M} BLOCK_N={BLOCK_N} STAGES={STAGES} warps={WARPS}; µs per layer "
          f"(32-layer CUDA graph)")
    print("tree | plan work items | Triton (fp32 partials) | Gluon | Gluon max|diff| vs ref | "
          "Triton max|diff|")
    for name, (tokens, queries) in SPIKE_TREES.items():
        layout = _shared_node(tokens, queries)
        gen = torch.Generator(device="cuda").manual_seed(0)
        ks = [torch.randn(tokens, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
              for _ in range(LAYERS)]
        vs = [torch.randn(tokens, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
              for _ in range(LAYERS)]
        q = torch.randn(queries, H_Q, D, device="cuda", dtype=DTYPE, generator=gen)
        out = torch.empty_like(q)
        attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda")
        attn.plan(layout)
        # The Gluon kernel's plan: row chunks of its own BLOCK_M (one warp group per 64 rows).
        tb._GPU_CONFIGS[D] = dataclasses.replace(base, wide=None, block_m=BLOCK_M)
        attn_g = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda")
        attn_g.plan(layout)
        tb._GPU_CONFIGS[D] = dataclasses.replace(base, wide=None)
        prep = attn_g._prepared
        work = prep.segment("work").view(-1)[:prep.num_work * 8].view(-1, 8).cpu()
        assert bool((work[:, 5] == work[:, 1]).all()), "a tile needs a mask"
        assert bool((work[:, 6] >= 0).all()) and prep.sorted_queries
        ref, _ = reference_attention(q, ks[0], vs[0], layout, D**-0.5)
        tri = attn.run(q, ks[0], vs[0]).double()
        _launch_gluon(attn_g, q, ks[0], vs[0], out)
        torch.cuda.synchronize()
        gdiff = float((out.double() - ref.double()).abs().max())
        tdiff = float((tri - ref.double()).abs().max())

        def triton_step() -> None:
            for layer in range(LAYERS):
                attn.run(q, ks[layer], vs[layer], out=out)

        def gluon_step() -> None:
            for layer in range(LAYERS):
                _launch_gluon(attn_g, q, ks[layer], vs[layer], out)

        t_us = _time(triton_step, graph=True) / LAYERS
        g_us = _time(gluon_step, graph=True) / LAYERS
        print(f"{name} | {prep.num_work * H_KV} | {t_us:.1f} | {g_us:.1f} | {gdiff:.2e} | "
              f"{tdiff:.2e}", flush=True)
        del ks, vs
        torch.cuda.empty_cache()
    tb._GPU_CONFIGS[D] = base


if __name__ == "__main__":
    main()
