"""A persistent, warp-specialised partial pass in Gluon over a real plan's work items (a spike).

The question it answers: how much of a small tree's partial pass is each program's start and
end (ncu on few-shot b=20: a fifth of the samples in the prologue, a sixth in the epilogue,
15% achieved occupancy), and would one program per SM that streams its share of (work item,
KV head) pairs back to back, the next pair's q and K/V loading while the current one runs,
take that away? Partitions: a loader warp (TMA of each pair's K/V blocks into one ring that
runs on across pairs), a q warpgroup (each pair's q rows, its work item and its queries'
visibility into a two-slot ring) and the consumer warpgroup (``wgmma`` and the online
softmax; the plan's visibility mask past ``mask_from``; the partial state out). Pairs go to
programs longest first onto the least-loaded one. Then the shipped merge launch.

Builds (``BUILDS``) vary the block, the ring, the next block's scores computed while the
softmax runs (``overlap``), and the isolation of non-finite K/V the kernel contract asks for
(``check``: 0 none, 1 a checker in the q warpgroup, 2 in the consumer as the shipped kernel
did it before its lean checks, 3 as 2 with zero padding rows as the K check, 4 timing only: 2
without the per-block -inf select, 5 the shipped kernel's lean checks: none in the blocks but
the -inf score made NaN by the exponent's FMA, and a pair whose accumulator or sums come out
non-finite computed again from global memory with every check, ``_checked_pair``), pairs of
at most 16 rows on 16-row ``mma.sync`` products (``small``), two consumer warpgroups taking
alternate pairs (``consumers``: each with a loader warp and its rings, q loaded by TMA from
one warp); and, for timing only, no softmax or no products at all
(what streaming alone takes).

The plan is the shipped backend's for the tree (``backend._pack``), so the tiles, row chunks
and partial states are DeFT's; only trees whose slots are all consecutive and queries sorted
qualify (the shipped kernel gathers the others); bf16 only. Output checked against the
shipped ``TreeAttention.run``, with non-finite values written into K and V for the
isolating builds; the shipped plan-specialised and graph-safe steps timed in the same
process, 32 layers replayed from a CUDA graph. Result: docs/decisions.md ("A persistent
partial pass in Gluon, measured").

Usage: ``python tools/persistent_gluon.py [--builds 0,5] [TREE ...]`` (H200); ``--compile-only``
compiles every build (``--builds`` does not apply) for sm_90a on any machine and prints
ptxas's registers and spills.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, even when run under the CPU test suite
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

H_Q, H_KV, D, LAYERS = 32, 8, 128, 32
G, M = H_Q // H_KV, 64
GROUP = gl.constexpr(G)  # query heads per KV head, inside the kernels
SMALL_ROWS = gl.constexpr(16)  # the most rows a pair may have for the ``small`` consumer
# Builds (see the top). One program per SM: the partitions take 384 threads (the loader
# warp's padded to 4), so two would need at most 85 registers each, and ptxas needs 94 for
# the wgmma instructions. The ``small`` builds and the two-consumer build with isolation spill
# under the 168-register cap.
BUILDS = [dict(block_n=64, stages=4), dict(block_n=64, stages=3), dict(block_n=32, stages=6),
          dict(block_n=64, stages=5), dict(block_n=64, stages=3, overlap=True),
          dict(block_n=64, stages=4, overlap=True), dict(block_n=32, stages=6, overlap=True),
          dict(block_n=64, stages=3, check=1), dict(block_n=64, stages=4, overlap=True, check=1),
          dict(block_n=64, stages=3, check=2), dict(block_n=64, stages=4, overlap=True, check=2),
          dict(block_n=64, stages=4, overlap=True, check=3),
          dict(block_n=64, stages=4, overlap=True, check=4),
          dict(block_n=64, stages=4, overlap=True, small=True),
          dict(block_n=64, stages=4, overlap=True, check=2, small=True),
          dict(block_n=64, stages=2, overlap=True, consumers=2),
          dict(block_n=64, stages=2, overlap=True, check=2, consumers=2),
          dict(block_n=64, stages=3, softmax=False),
          dict(block_n=64, stages=3, compute=False),
          dict(block_n=64, stages=5, compute=False),
          dict(block_n=64, stages=4, overlap=True, check=5),
          dict(block_n=64, stages=3, check=5)]
DEFAULT_TREES = ["few-shot b=20", "few-shot b=50", "speculative t=64", "long prompt 32k x16"]


@gluon.jit
def _pick(x, i: gl.constexpr):
    """Element ``i`` of the small int tensor ``x`` as a scalar."""
    return gl.sum(gl.where(gl.arange(0, x.type.shape[0], x.type.layout) == i, x, 0), 0)


@gluon.jit
def _kv_loader(k_desc, v_desc, work, sched, lo, hi, kbuf, vbuf, kv_empty, kv_ready, h_kv,
               first, step, rb, S: gl.constexpr):
    """The K/V blocks of pairs ``first, first + step, ...`` by TMA into the ring of ``S``
    slots from ``rb``, on across pairs."""
    BLOCK_N: gl.constexpr = kbuf.type.shape[1]
    DH: gl.constexpr = kbuf.type.shape[2]
    c = 0
    for j in range(lo + first, hi, step):
        pair = gl.load(sched + j)
        w = pair // h_kv
        col = (pair % h_kv) * DH
        tok0 = gl.load(work + w * 8)
        tok1 = gl.load(work + w * 8 + 1)
        slot0 = gl.load(work + w * 8 + 6)
        for start in range(tok0, tok1, BLOCK_N):
            idx = rb + c % S
            mbarrier.wait(kv_empty.index(idx), ((c // S) & 1) ^ 1)
            bar = kv_ready.index(idx)
            mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
            row = slot0 + (start - tok0)
            tma.async_copy_global_to_shared(k_desc, [row, col], bar, kbuf.index(idx))
            tma.async_copy_global_to_shared(v_desc, [row, col], bar, vbuf.index(idx))
            c += 1


@gluon.jit
def _load_q(t, Q, work, sched, lo, q_pre, q_len, qbuf, dbuf, pbuf, lbuf, q_empty, q_ready,
            stride_qn, h_kv, SMALL: gl.constexpr, CONS: gl.constexpr):
    """Pair ``t``'s q rows (zeros past its rows), work item and rows' node and length, into
    the two-slot ring of consumer ``t % CONS``; with ``SMALL``, a pair of at most
    ``SMALL_ROWS`` rows has them repeated down the slot (``_small_pair`` gives each warp a
    copy)."""
    MR: gl.constexpr = qbuf.type.shape[1]
    DH: gl.constexpr = qbuf.type.shape[2]
    GQ: gl.constexpr = GROUP
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    l1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    r = gl.arange(0, MR, gl.SliceLayout(1, layout))
    c = gl.arange(0, DH, gl.SliceLayout(0, layout))
    r1 = gl.arange(0, MR, l1)
    pair = gl.load(sched + lo + t)
    w = pair // h_kv
    kvh = pair % h_kv
    desc = gl.load(work + w * 8 + gl.arange(0, 8, l1))
    qs = gl.load(work + w * 8 + 2)
    qe = gl.load(work + w * 8 + 3)
    row0 = gl.load(work + w * 8 + 7)
    if SMALL:
        rows = row0 + gl.where((qe - qs) * GQ - row0 <= SMALL_ROWS, r % SMALL_ROWS, r)
    else:
        rows = row0 + r
    ok = rows < (qe - qs) * GQ
    qpos = qs + rows // GQ
    head = kvh * GQ + rows % GQ
    q = gl.load(Q + gl.expand_dims(qpos * stride_qn + head * DH, 1) + gl.expand_dims(c, 0),
                mask=gl.expand_dims(ok, 1), other=0.0)
    rows1 = row0 + r1
    ok1 = rows1 < (qe - qs) * GQ
    pre = gl.load(q_pre + qs + rows1 // GQ, mask=ok1, other=-1)
    qlen = gl.load(q_len + qs + rows1 // GQ, mask=ok1, other=0)
    u = t // CONS  # the pair's place among its consumer's
    idx = (t % CONS) * 2 + u % 2
    mbarrier.wait(q_empty.index(idx), ((u // 2) & 1) ^ 1)
    qbuf.index(idx).store(q)
    dbuf.index(idx).store(desc)
    pbuf.index(idx).store(pre)
    lbuf.index(idx).store(qlen)
    fence_async_shared()  # the generic stores before the consumer's wgmma
    mbarrier.arrive(q_ready.index(idx), count=1)


@gluon.jit
def _q_tma_loader(q_desc, work, sched, lo, hi, q_pre, q_len, qbuf, dbuf, pbuf, lbuf, q_empty,
                  q_ready, h_kv, CONS: gl.constexpr):
    """One warp's ``_load_q`` for two consumers: each pair's q rows by TMA (a box of 16
    queries' 4 heads; rows past the pair's hold other queries' q, which no output keeps)."""
    MR: gl.constexpr = qbuf.type.shape[1]
    DH: gl.constexpr = qbuf.type.shape[2]
    GQ: gl.constexpr = GROUP
    l1: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
    r1 = gl.arange(0, MR, l1)
    for t in range(hi - lo):
        pair = gl.load(sched + lo + t)
        w = pair // h_kv
        kvh = pair % h_kv
        desc = gl.load(work + w * 8 + gl.arange(0, 8, gl.BlockedLayout([1], [32], [1], [0])))
        qs = gl.load(work + w * 8 + 2)
        qe = gl.load(work + w * 8 + 3)
        row0 = gl.load(work + w * 8 + 7)
        rows1 = row0 + r1
        ok1 = rows1 < (qe - qs) * GQ
        pre = gl.load(q_pre + qs + rows1 // GQ, mask=ok1, other=-1)
        qlen = gl.load(q_len + qs + rows1 // GQ, mask=ok1, other=0)
        u = t // CONS
        idx = (t % CONS) * 2 + u % 2
        mbarrier.wait(q_empty.index(idx), ((u // 2) & 1) ^ 1)
        dbuf.index(idx).store(desc)
        pbuf.index(idx).store(pre)
        lbuf.index(idx).store(qlen)
        fence_async_shared()
        bar = q_ready.index(idx)
        mbarrier.expect(bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [qs + row0 // GQ, kvh * GQ, 0], bar,
                                        qbuf.index(idx).reshape([MR // GQ, GQ, DH]))


@gluon.jit
def _q_loader(Q, work, sched, lo, hi, q_pre, q_len, qbuf, dbuf, pbuf, lbuf, q_empty, q_ready,
              kbuf, vbuf, kv_ready, chk_ready, fbuf, stride_qn, h_kv, CHECK: gl.constexpr,
              SMALL: gl.constexpr, CONS: gl.constexpr):
    """Each pair's q (see ``_load_q``). ``CHECK`` 1: also, as each K/V block lands, which of its
    tokens' K (bit 0) or V (bit 1) rows hold a NaN or inf, for the consumer (the next pair's
    q loads first)."""
    if CHECK == 1:
        BLOCK_N: gl.constexpr = kbuf.type.shape[1]
        S: gl.constexpr = kbuf.type.shape[0]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        _load_q(0, Q, work, sched, lo, q_pre, q_len, qbuf, dbuf, pbuf, lbuf, q_empty, q_ready,
                stride_qn, h_kv, SMALL, CONS)
        c = 0
        for t in range(hi - lo):
            if t + 1 < hi - lo:
                _load_q(t + 1, Q, work, sched, lo, q_pre, q_len, qbuf, dbuf, pbuf, lbuf, q_empty,
                        q_ready, stride_qn, h_kv, SMALL, CONS)
            w = gl.load(sched + lo + t) // h_kv
            for start in range(gl.load(work + w * 8), gl.load(work + w * 8 + 1), BLOCK_N):
                idx = c % S
                mbarrier.wait(kv_ready.index(idx), (c // S) & 1)
                kb = gl.max(gl.where(gl.abs(kbuf.index(idx).load(layout)) < float("inf"), 0, 1), 1)
                vb = gl.max(gl.where(gl.abs(vbuf.index(idx).load(layout)) < float("inf"), 0, 1), 1)
                fbuf.index(idx).store(kb + 2 * vb)
                mbarrier.arrive(chk_ready.index(idx), count=1)
                c += 1
    else:
        for t in range(hi - lo):
            _load_q(t, Q, work, sched, lo, q_pre, q_len, qbuf, dbuf, pbuf, lbuf, q_empty,
                    q_ready, stride_qn, h_kv, SMALL, CONS)


@gluon.jit
def _zero_bad_v(vbuf, fbuf, idx, bad):
    """Zero the V rows of block ``idx`` that the checks flagged (those tokens' probabilities
    are made NaN for the rows that see them instead: a 0 probability times NaN is NaN)."""
    if bad != 0:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        v = vbuf.index(idx).load(layout)
        flags = fbuf.index(idx).load(gl.SliceLayout(1, layout))
        vbuf.index(idx).store(gl.where(gl.expand_dims((flags & 2) != 0, 1), 0.0, v))
        fence_async_shared()  # before the product's wgmma reads it


@gluon.jit
def _online(s, m_i, l_i, qk_scale):
    """Online-softmax step over raw scores ``s`` (-inf where not seen): probabilities, running
    max and sum, and the accumulator's rescale."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _visible(cols, zero_i, tok1, mask_from, pre, qlen, tok_lo, tok_hi, tok_off):
    """Which rows see which of a block's plan tokens ``cols``: none past ``tok1``, every row
    those before ``mask_from``, and from there the rows whose node (``pre``) lies in the
    token's range (``tok_lo``, ``tok_hi``; at the range's first node only the rows whose
    length ``qlen`` passes the token's offset ``tok_off``). ``zero_i``: int zeros of the
    scores' shape and layout."""
    need = (cols < tok1) & (cols >= mask_from)
    lo_t = gl.expand_dims(gl.load(tok_lo + cols, mask=need, other=0), 0)
    hi_t = gl.expand_dims(gl.load(tok_hi + cols, mask=need, other=0), 0)
    off_t = gl.expand_dims(gl.load(tok_off + cols, mask=need, other=0), 0)
    seen = (lo_t <= pre) & (pre < hi_t) & ((pre != lo_t) | (off_t < qlen))
    return (gl.expand_dims(cols, 0) + zero_i < tok1) & (seen | gl.expand_dims(cols < mask_from, 0))


@gluon.jit
def _online_fma(s, vis, m_i, l_i, qk_scale, MASKED: gl.constexpr):
    """``_online`` with the shipped kernel's -inf check: the exponent's offset is ``s * 0 -
    m``, ``-m`` for a finite score and NaN for ±inf or NaN, so a non-finite K row leaves a NaN
    probability in every row that sees it (``MASKED``: only where ``vis``, the others' 0)."""
    if MASKED:
        m_new = gl.maximum(m_i, gl.max(gl.where(vis, s, float("-inf")), 1) * qk_scale)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(gl.fma(s, qk_scale, gl.fma(s, 0.0, -gl.expand_dims(m_new, 1))))
    if MASKED:
        p = gl.where(vis, p, 0.0)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _checked_pair(K, V, stride_kn, qbuf, qi, pbuf, lbuf, kvh, tok0, tok1, slot0, mask_from,
                  tok_lo, tok_hi, tok_off, qk_scale, CB: gl.constexpr):
    """A pair's state computed again with every check, from K and V in global memory (its
    slots from ``slot0``), ``CB`` tokens a block on ``mma.sync`` (the cold path of ``CHECK``
    5): a -inf score becomes NaN, masked scores are selected away, a non-finite V row is
    zeroed and the probabilities of the rows that see it made NaN. Returns ``acc`` (in the
    ``mma`` layout), ``m_i`` and ``l_i``; a row that saw a non-finite K/V row has a NaN sum."""
    MR: gl.constexpr = qbuf.type.shape[1]
    DH: gl.constexpr = qbuf.type.shape[2]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row: gl.constexpr = gl.SliceLayout(1, mma)
    col: gl.constexpr = gl.SliceLayout(0, mma)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [CB, DH]
    q = qbuf.index(qi).load(a_l)
    pre = gl.expand_dims(pbuf.index(qi).load(row), 1)
    qlen = gl.expand_dims(lbuf.index(qi).load(row), 1)
    t_b = gl.arange(0, CB, gl.SliceLayout(1, blk))
    d_b = gl.arange(0, DH, gl.SliceLayout(0, blk))
    zero_s = gl.zeros([MR, CB], gl.float32, mma)
    zero_i = gl.zeros([MR, CB], gl.int32, mma)
    m_i = gl.full([MR], -1.0e30, gl.float32, row)
    l_i = gl.zeros([MR], gl.float32, row)
    acc = gl.zeros([MR, DH], gl.float32, mma)
    for start in range(tok0, tok1, CB):
        inb = gl.expand_dims(start + t_b < tok1, 1)
        offs = (gl.expand_dims((slot0 + start - tok0 + t_b).to(gl.int64) * stride_kn, 1)
                + kvh * DH + gl.expand_dims(d_b, 0))
        k = gl.load(K + offs, mask=inb, other=0.0)
        v = gl.load(V + offs, mask=inb, other=0.0)
        s = mma_v2(q, gl.convert_layout(gl.permute(k, (1, 0)), b_l), zero_s)
        s = gl.where(s == float("-inf"), float("nan"), s)
        cols = start + gl.arange(0, CB, col)
        vis = _visible(cols, zero_i, tok1, mask_from, pre, qlen, tok_lo, tok_hi, tok_off)
        p, m_i, l_i, alpha = _online(gl.where(vis, s, float("-inf")), m_i, l_i, qk_scale)
        v_bad = gl.max(gl.where(gl.abs(v) < float("inf"), 0, 1), 1)  # [CB]
        bad_v = vis & gl.expand_dims(gl.convert_layout(v_bad, col) > 0, 0)
        l_i = gl.where(gl.max(bad_v.to(gl.int32), 1) > 0, float("nan"), l_i)
        p = gl.where(bad_v, float("nan"), p)
        v = gl.where(gl.abs(v) < float("inf"), v, 0.0)
        acc = mma_v2(gl.convert_layout(p.to(v.dtype), a_l), gl.convert_layout(v, b_l),
                     acc * gl.expand_dims(alpha, 1))
    return acc, m_i, l_i


@gluon.jit
def _v_check(vbuf, idx):
    """Per token of V block ``idx``, 1 where its row holds a NaN or inf (then zeroed in shared
    memory, before the product reads it)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    v = vbuf.index(idx).load(layout)
    flags = gl.max(gl.where(gl.abs(v) < float("inf"), 0, 1), 1)
    if gl.max(flags, 0) > 0:
        vbuf.index(idx).store(gl.where(gl.expand_dims(flags > 0, 1), 0.0, v))
        fence_async_shared()
    return flags


@gluon.jit
def _softmax(s, start, cols, zero_i, tok1, mask_from, pre, qlen, tok_lo, tok_hi, tok_off, m_i,
             l_i, qk_scale, flags, bad, vbuf, idx, full, SOFTMAX: gl.constexpr,
             CHECK: gl.constexpr):
    """One block's probabilities (tokens past ``tok1`` and, from ``mask_from``, those a row
    does not see get none), the running max and sum, and the accumulator's rescale. ``cols``:
    the block's plan tokens, from ``start``; ``zero_i``: int zeros of the scores' shape and
    layout. Isolation of non-finite K/V (``CHECK``): 1, ``flags`` from the checker (per token:
    bit 0 its K row, bit 1 its V row is not finite; ``bad``: some flag is set) make the scores
    (K) or probabilities (V) of the rows that see the token NaN; 2, as the shipped kernel does
    it: a -inf score becomes NaN (NaN and +inf make the row NaN by themselves), and in a
    masked or tail block the V rows are checked here (``_v_check``); 3, as 2 but in the other
    blocks of an item with padding rows (not ``full``), whose zero q rows score NaN against a
    non-finite K row, the consumer checks those rows' sums once at the item's end instead;
    4 (timing only: what the per-block select costs), as 2 without the -inf select outside
    masked and tail blocks. Without ``SOFTMAX`` (timing only): the raw scores, no masks."""
    BLOCK_N: gl.constexpr = s.type.shape[1]
    if SOFTMAX:
        # mask_from <= tok1: a block wholly before mask_from, with no flagged token, needs
        # neither mask nor tail.
        slow = start + BLOCK_N > mask_from
        if CHECK == 1:
            slow = slow | (bad != 0)
        if slow:
            vis = _visible(cols, zero_i, tok1, mask_from, pre, qlen, tok_lo, tok_hi, tok_off)
            if CHECK == 1:
                s = gl.where(vis & gl.expand_dims((flags & 1) != 0, 0), float("nan"), s)
            if CHECK >= 2 and CHECK != 5:
                s = gl.where(s == float("-inf"), float("nan"), s)
            if CHECK == 5:
                p, m_i, l_i, alpha = _online_fma(s, vis, m_i, l_i, qk_scale, True)
            else:
                p, m_i, l_i, alpha = _online(gl.where(vis, s, float("-inf")), m_i, l_i, qk_scale)
            if CHECK != 0 and CHECK != 5:
                if CHECK == 1:
                    bad_v = vis & gl.expand_dims((flags & 2) != 0, 0)
                else:
                    v_flags = gl.convert_layout(_v_check(vbuf, idx), cols.type.layout)
                    bad_v = vis & gl.expand_dims(v_flags > 0, 0)
                # A NaN probability makes the row's sum NaN too.
                l_i = gl.where(gl.max(bad_v.to(gl.int32), 1) > 0, float("nan"), l_i)
                p = gl.where(bad_v, float("nan"), p)
        else:
            if CHECK == 2:
                s = gl.where(s == float("-inf"), float("nan"), s)
            if CHECK == 3:
                if full:
                    s = gl.where(s == float("-inf"), float("nan"), s)
            if CHECK == 5:
                p, m_i, l_i, alpha = _online_fma(s, s, m_i, l_i, qk_scale, False)
            else:
                p, m_i, l_i, alpha = _online(s, m_i, l_i, qk_scale)
    else:
        p = s
        alpha = l_i + 1.0
    return p, m_i, l_i, alpha


@gluon.jit
def _flags(fbuf, idx, ncol, CHECK: gl.constexpr):
    """Block ``idx``'s per-token flags (``_q_loader``) and whether any is set; zeros unless
    ``CHECK`` is 1."""
    if CHECK == 1:
        flags = fbuf.index(idx).load(ncol.type.layout)
    else:
        flags = ncol * 0
    return flags, gl.max(flags, 0)


@gluon.jit
def _small_pair(c, rb, qi, kvh, tok0, tok1, nq, p0, mask_from, row0, qbuf, pbuf, kbuf, vbuf,
                lbuf, ready, kv_empty, tok_lo, tok_hi, tok_off, PO, PLSE, qk_scale, stride_pn,
                CHECK: gl.constexpr, S: gl.constexpr):
    """A pair of at most ``SMALL_ROWS`` rows: each warp takes a quarter of every K/V block's
    tokens with 16-row ``mma.sync`` products and keeps its own online softmax, so the softmax
    and the products cover 16 rows rather than 64; the four warps' states merge at the end.
    Isolation as ``CHECK`` 2 (0: none). ``rb``: the K/V ring's first slot. Returns the ring
    position after the pair's blocks."""
    BLOCK_N: gl.constexpr = kbuf.type.shape[1]
    DH: gl.constexpr = kbuf.type.shape[2]
    GQ: gl.constexpr = GROUP
    R: gl.constexpr = SMALL_ROWS
    W: gl.constexpr = 4
    T: gl.constexpr = BLOCK_N // W  # tokens per warp and block
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1],
                                                  instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    st: gl.constexpr = gl.SliceLayout(2, mma)  # [W, R]: a warp's per-row state
    bl3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [W, 1, 1], [2, 1, 0])
    pre = gl.expand_dims(pbuf.index(qi).slice(0, R).load(gl.SliceLayout(0, st)), 0)
    qlen = gl.expand_dims(lbuf.index(qi).slice(0, R).load(gl.SliceLayout(0, st)), 0)
    pre = gl.expand_dims(pre, 2)
    qlen = gl.expand_dims(qlen, 2)
    # Token j of warp w in a block: start + w * T + j, as [W, 1, T].
    wi = gl.arange(0, W, gl.SliceLayout(1, st))
    ji = gl.arange(0, T, gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    tok_w = gl.expand_dims(gl.expand_dims(wi * T, 1), 2) + gl.expand_dims(gl.expand_dims(ji, 0), 1)
    zero_s = gl.zeros([W, R, T], gl.float32, mma)
    m_i = gl.full([W, R], -1.0e30, gl.float32, st)
    l_i = gl.zeros([W, R], gl.float32, st)
    acc = gl.zeros([W, R, DH], gl.float32, mma)
    for start in range(tok0, tok1, BLOCK_N):
        idx = rb + c % S
        mbarrier.wait(ready.index(idx), (c // S) & 1)
        # The slot holds the pair's rows once per warp (``_load_q``): loaded each block, so
        # they hold no registers across the loop.
        q3 = qbuf.index(qi).reshape([W, R, DH]).load(a_l)
        k3 = kbuf.index(idx).reshape([W, T, DH]).permute((0, 2, 1)).load(b_l)
        s = mma_v2(q3, k3, zero_s)
        cols = start + tok_w
        if CHECK != 0:
            s = gl.where(s == float("-inf"), float("nan"), s)
        slow = start + BLOCK_N > mask_from
        if slow:
            need = (cols < tok1) & (cols >= mask_from)
            lo_t = gl.load(tok_lo + cols, mask=need, other=0)
            hi_t = gl.load(tok_hi + cols, mask=need, other=0)
            off_t = gl.load(tok_off + cols, mask=need, other=0)
            seen = (lo_t <= pre) & (pre < hi_t) & ((pre != lo_t) | (off_t < qlen))
            vis = (cols + gl.zeros([W, R, T], gl.int32, mma) < tok1) & (seen | (cols < mask_from))
            s = gl.where(vis, s, float("-inf"))
        else:
            vis = gl.full([W, R, T], 1, gl.int1, mma)
        m_new = gl.maximum(m_i, gl.max(s, 2) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 2))
        l_i = l_i * alpha + gl.sum(p, 2)
        m_i = m_new
        if CHECK != 0:
            if slow:
                vchk = vbuf.index(idx).reshape([W, T, DH]).load(bl3)
                v_bad = gl.max(gl.where(gl.abs(vchk) < float("inf"), 0, 1), 2)  # [W, T]
                if gl.max(gl.max(v_bad, 1), 0) > 0:
                    vbuf.index(idx).reshape([W, T, DH]).store(
                        gl.where(gl.expand_dims(v_bad, 2) > 0, 0.0, vchk))
                    fence_async_shared()
                v_bad = gl.convert_layout(v_bad, gl.SliceLayout(1, mma))
                bad_v = vis & (gl.expand_dims(v_bad, 1) > 0)
                l_i = gl.where(gl.max(bad_v.to(gl.int32), 2) > 0, float("nan"), l_i)
                p = gl.where(bad_v, float("nan"), p)
        v3 = vbuf.index(idx).reshape([W, T, DH]).load(b_l)
        mbarrier.arrive(kv_empty.index(idx), count=1)
        acc = mma_v2(gl.convert_layout(p.to(v3.dtype), a_l), v3,
                     acc * gl.expand_dims(alpha, 2))
        c += 1
    # The warps' states merged into the rows'.
    m_row = gl.max(m_i, 0)
    scale = gl.exp2(m_i - gl.expand_dims(m_row, 0))
    l_row = gl.sum(l_i * scale, 0)
    o_un = gl.sum(acc * gl.expand_dims(scale, 2), 0)  # [R, DH]
    out_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    o_un = gl.convert_layout(o_un, out_l)
    r_o = gl.arange(0, R, gl.SliceLayout(1, out_l))
    l_o = gl.convert_layout(l_row, gl.SliceLayout(1, out_l))
    has_o = l_o > 0
    o = o_un / gl.expand_dims(gl.where(has_o, l_o, 1.0), 1)
    m_o = gl.convert_layout(m_row, gl.SliceLayout(1, out_l))
    lse = gl.where(has_o, (m_o + gl.log2(gl.where(has_o, l_o, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    if CHECK != 0:
        row_bad = (gl.max(gl.where(gl.abs(o) < float("inf"), 0, 1), 1) > 0) | (l_o != l_o)
        o = gl.where(gl.expand_dims(row_bad, 1), float("nan"), o)
        lse = gl.where(row_bad, float("nan"), lse)
    rows = row0 + r_o
    ok = rows < nq * GQ
    head = kvh * GQ + rows % GQ
    dcol = gl.arange(0, DH, gl.SliceLayout(0, out_l))
    offs = gl.expand_dims((p0 + rows // GQ).to(gl.int64) * stride_pn + head * DH, 1)
    gl.store(PO + offs + gl.expand_dims(dcol, 0), o, mask=gl.expand_dims(ok, 1))
    gl.store(PLSE + (p0 + rows // GQ) * (stride_pn // DH) + head, lse, mask=ok)
    return c


@gluon.jit
def _consumer(sched, lo, hi, tok_lo, tok_hi, tok_off, qbuf, dbuf, pbuf, lbuf, kbuf, vbuf,
              q_empty, q_ready, kv_empty, kv_ready, chk_ready, fbuf, PO, PLSE, K, V, stride_kn,
              qk_scale, stride_pn, h_kv, SOFTMAX: gl.constexpr, OVERLAP: gl.constexpr,
              CHECK: gl.constexpr, SMALL: gl.constexpr, first, step, qb, rb,
              S: gl.constexpr):
    """The partial states of pairs ``first, first + step, ...``, through the q ring of two
    slots from ``qb`` and the K/V ring of ``S`` slots from ``rb`` (its own). ``OVERLAP``: the
    next block's ``q @ K.T`` and this one's ``p @ V`` are in flight while the softmax runs
    (each block's scores are waited for before its softmax, its product before the rescale
    that follows). ``CHECK``: blocks are taken once checked (``_q_loader``) where it is 1,
    non-finite K/V isolated (``_softmax``, ``_zero_bad_v``), and a row whose output is not
    finite made NaN (o and lse); where it is 5, a pair whose rows' accumulator sums or
    softmax sums are not all finite is computed again (``_checked_pair``, from ``K`` and
    ``V`` with rows ``stride_kn`` apart) before its q slot is handed back. ``SMALL``: pairs
    of at most ``SMALL_ROWS`` rows go to ``_small_pair``."""
    MR: gl.constexpr = qbuf.type.shape[1]
    BLOCK_N: gl.constexpr = kbuf.type.shape[1]
    DH: gl.constexpr = kbuf.type.shape[2]
    GQ: gl.constexpr = GROUP
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DH, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    l8: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ncol = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    if CHECK == 1:
        ready = chk_ready
    else:
        ready = kv_ready
    c = 0
    for t in range(first, hi - lo, step):
        pair = gl.load(sched + lo + t)
        kvh = pair % h_kv
        u = t // step
        qi = qb + u % 2
        mbarrier.wait(q_ready.index(qi), (u // 2) & 1)
        desc = dbuf.index(qi).load(l8)
        tok0 = _pick(desc, 0)
        tok1 = _pick(desc, 1)
        nq = _pick(desc, 3) - _pick(desc, 2)
        p0 = _pick(desc, 4)
        mask_from = _pick(desc, 5)
        row0 = _pick(desc, 7)
        if SMALL:
            few = nq * GQ - row0 <= SMALL_ROWS
        else:
            few = nq < 0
        if few:
            if SMALL:  # (few is false otherwise: the call is compiled only where it may run)
                c = _small_pair(c, rb, qi, kvh, tok0, tok1, nq, p0, mask_from, row0, qbuf, pbuf,
                                kbuf, vbuf, lbuf, ready, kv_empty, tok_lo, tok_hi, tok_off, PO,
                                PLSE, qk_scale, stride_pn, CHECK, S)
            mbarrier.arrive(q_empty.index(qi), count=1)
        else:
            full = nq * GQ - row0 >= MR  # no padding rows
            zero_s = gl.zeros([MR, BLOCK_N], gl.float32, s_layout)
            zero_i = gl.zeros([MR, BLOCK_N], gl.int32, s_layout)
            pre = gl.expand_dims(pbuf.index(qi).load(row_s), 1)
            qlen = gl.expand_dims(lbuf.index(qi).load(row_s), 1)
            m_i = gl.full([MR], -1.0e30, gl.float32, row_s)
            l_i = gl.zeros([MR], gl.float32, row_s)
            acc = gl.zeros([MR, DH], gl.float32, o_layout)
            if OVERLAP:
                mbarrier.wait(ready.index(rb + c % S), (c // S) & 1)
                s = warpgroup_mma(qbuf.index(qi), kbuf.index(rb + c % S).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
                flags, bad = _flags(fbuf, c % S, ncol, CHECK)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                p, m_i, l_i, alpha = _softmax(s, tok0, tok0 + ncol, zero_i, tok1, mask_from, pre,
                                              qlen, tok_lo, tok_hi, tok_off, m_i, l_i, qk_scale,
                                              flags, bad, vbuf, rb + c % S, full, SOFTMAX, CHECK)
                if CHECK == 1:
                    _zero_bad_v(vbuf, fbuf, c % S, bad)
                for start in range(tok0 + BLOCK_N, tok1, BLOCK_N):
                    nxt = c + 1
                    mbarrier.wait(ready.index(rb + nxt % S), (nxt // S) & 1)
                    s = warpgroup_mma(qbuf.index(qi), kbuf.index(rb + nxt % S).permute((1, 0)),
                                      zero_s, use_acc=False, is_async=True)
                    pv = gl.convert_layout(p.to(vbuf.dtype), p_layout)
                    acc = warpgroup_mma(pv, vbuf.index(rb + c % S), acc, is_async=True)
                    flags, bad = _flags(fbuf, nxt % S, ncol, CHECK)
                    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, pv))[0]
                    p, m_i, l_i, alpha = _softmax(s, start, start + ncol, zero_i, tok1, mask_from,
                                                  pre, qlen, tok_lo, tok_hi, tok_off, m_i, l_i,
                                                  qk_scale, flags, bad, vbuf, rb + nxt % S, full,
                                                  SOFTMAX, CHECK)
                    if CHECK == 1:
                        _zero_bad_v(vbuf, fbuf, nxt % S, bad)
                    # p @ V reads pv from registers: kept alive until it is done.
                    acc, pv = warpgroup_mma_wait(num_outstanding=0, deps=(acc, pv))
                    mbarrier.arrive(kv_empty.index(rb + c % S), count=1)
                    if SOFTMAX:
                        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                    c = nxt
                pv = gl.convert_layout(p.to(vbuf.dtype), p_layout)
                acc = warpgroup_mma(pv, vbuf.index(rb + c % S), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(kv_empty.index(rb + c % S), count=1)
                c += 1
            else:
                for start in range(tok0, tok1, BLOCK_N):
                    idx = rb + c % S
                    mbarrier.wait(ready.index(idx), (c // S) & 1)
                    s = warpgroup_mma(qbuf.index(qi), kbuf.index(idx).permute((1, 0)), zero_s,
                                      use_acc=False, is_async=True)
                    flags, bad = _flags(fbuf, idx, ncol, CHECK)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                    p, m_i, l_i, alpha = _softmax(s, start, start + ncol, zero_i, tok1, mask_from,
                                                  pre, qlen, tok_lo, tok_hi, tok_off, m_i, l_i,
                                                  qk_scale, flags, bad, vbuf, idx, full, SOFTMAX,
                                                  CHECK)
                    if CHECK == 1:
                        _zero_bad_v(vbuf, fbuf, idx, bad)
                    if SOFTMAX:
                        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                    pv = gl.convert_layout(p.to(vbuf.dtype), p_layout)
                    acc = warpgroup_mma(pv, vbuf.index(idx), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    mbarrier.arrive(kv_empty.index(idx), count=1)
                    c += 1
            if CHECK == 5:
                valid = gl.arange(0, MR, row_s) < nq * GQ - row0
                sums = gl.convert_layout(gl.sum(acc, 1), row_s)
                fine = (gl.abs(sums) < float("inf")) & (gl.abs(l_i) < float("inf"))
                redo = gl.max(gl.where(valid & ~fine, 1, 0), 0)
                row_bad = gl.zeros([MR], gl.int32, row_o) > 0
                if redo > 0:
                    acc2, m_i, l_i = _checked_pair(K, V, stride_kn, qbuf, qi, pbuf, lbuf, kvh,
                                                   tok0, tok1, _pick(desc, 6), mask_from,
                                                   tok_lo, tok_hi, tok_off, qk_scale, 16)
                    acc = gl.convert_layout(acc2, o_layout)
                    m_i = gl.convert_layout(m_i, row_s)
                    l_i = gl.convert_layout(l_i, row_s)
                    row_bad = gl.max(gl.where(gl.abs(acc) < float("inf"), 0, 1), 1) > 0
            mbarrier.arrive(q_empty.index(qi), count=1)
            has = l_i > 0
            l_o = gl.convert_layout(gl.where(has, l_i, 1.0), row_o)
            o = acc / gl.expand_dims(l_o, 1)
            if CHECK == 5:
                o = gl.where(gl.expand_dims(row_bad, 1), float("nan"), o)
            elif CHECK:
                row_bad = gl.max(gl.where(gl.abs(o) < float("inf"), 0, 1), 1) > 0
                if CHECK == 3:
                    # A padding row's NaN sum: a non-finite K row that every row sees.
                    pad = gl.arange(0, MR, row_s) >= nq * GQ - row0
                    seen_bad = gl.max(gl.where(pad & (l_i != l_i), 1, 0), 0)
                    row_bad = row_bad | (seen_bad > 0)
                o = gl.where(gl.expand_dims(row_bad, 1), float("nan"), o)
            rows = row0 + gl.arange(0, MR, row_o)
            ok = rows < nq * GQ
            head = kvh * GQ + rows % GQ
            dcol = gl.arange(0, DH, gl.SliceLayout(0, o_layout))
            offs = gl.expand_dims((p0 + rows // GQ).to(gl.int64) * stride_pn + head * DH, 1)
            gl.store(PO + offs + gl.expand_dims(dcol, 0), o, mask=gl.expand_dims(ok, 1))
            rows_s = row0 + gl.arange(0, MR, row_s)
            lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453,
                           float("-inf"))
            if CHECK:
                lse = gl.where(gl.convert_layout(row_bad, row_s) | (l_i != l_i), float("nan"), lse)
            gl.store(PLSE + (p0 + rows_s // GQ) * (stride_pn // DH) + kvh * GQ + rows_s % GQ, lse,
                     mask=rows_s < nq * GQ)


@gluon.jit
def _streamer(sched, lo, hi, dbuf, kbuf, q_empty, q_ready, kv_empty, kv_ready):
    """The consumer's hand-over of each pair's q and K/V blocks, and nothing else: what
    streaming alone takes."""
    BLOCK_N: gl.constexpr = kbuf.type.shape[1]
    S: gl.constexpr = kbuf.type.shape[0]
    l8: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    c = 0
    for t in range(hi - lo):
        qi = t % 2
        mbarrier.wait(q_ready.index(qi), (t // 2) & 1)
        desc = dbuf.index(qi).load(l8)
        for start in range(_pick(desc, 0), _pick(desc, 1), BLOCK_N):
            mbarrier.wait(kv_ready.index(c % S), (c // S) & 1)
            mbarrier.arrive(kv_empty.index(c % S), count=1)
            c += 1
        mbarrier.arrive(q_empty.index(qi), count=1)


@gluon.jit
def persistent_partial_kernel(Q, q_desc, k_desc, v_desc, PO, PLSE, work, sched, cta_ptr, tok_lo,
                              tok_hi, tok_off, q_pre, q_len, K, V, stride_kn, qk_scale,
                              stride_qn, stride_pn, h_kv,
                              MR: gl.constexpr, DH: gl.constexpr, BLOCK_N: gl.constexpr,
                              STAGES: gl.constexpr, COMPUTE: gl.constexpr,
                              SOFTMAX: gl.constexpr, OVERLAP: gl.constexpr, CHECK: gl.constexpr,
                              SMALL: gl.constexpr, CONS: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    lo = gl.load(cta_ptr + pid)
    hi = gl.load(cta_ptr + pid + 1)
    dt: gl.constexpr = k_desc.dtype
    # Per consumer: a two-slot q ring and a K/V ring of STAGES slots.
    qbuf = gl.allocate_shared_memory(dt, [2 * CONS, MR, DH],
                                     gl.NVMMASharedLayout.get_default_for([MR, DH], dt))
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    dbuf = gl.allocate_shared_memory(gl.int32, [2 * CONS, 8], plain)
    pbuf = gl.allocate_shared_memory(gl.int32, [2 * CONS, MR], plain)
    lbuf = gl.allocate_shared_memory(gl.int32, [2 * CONS, MR], plain)
    fbuf = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], plain)
    kbuf = gl.allocate_shared_memory(dt, [CONS * STAGES, BLOCK_N, DH], k_desc.layout)
    vbuf = gl.allocate_shared_memory(dt, [CONS * STAGES, BLOCK_N, DH], v_desc.layout)
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * CONS, 1], bl)
    q_ready = gl.allocate_shared_memory(gl.int64, [2 * CONS, 1], bl)
    kv_empty = gl.allocate_shared_memory(gl.int64, [CONS * STAGES, 1], bl)
    kv_ready = gl.allocate_shared_memory(gl.int64, [CONS * STAGES, 1], bl)
    chk_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bl)
    for i in gl.static_range(2 * CONS):
        mbarrier.init(q_empty.index(i), count=1)
        mbarrier.init(q_ready.index(i), count=1)
    for i in gl.static_range(CONS * STAGES):
        mbarrier.init(kv_empty.index(i), count=1)
        mbarrier.init(kv_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(chk_ready.index(i), count=1)
    fence_async_shared()
    if not COMPUTE:
        gl.warp_specialize([
            (_streamer, (sched, lo, hi, dbuf, kbuf, q_empty, q_ready, kv_empty, kv_ready)),
            (_kv_loader, (k_desc, v_desc, work, sched, lo, hi, kbuf, vbuf, kv_empty, kv_ready,
                          h_kv, 0, 1, 0, STAGES)),
            (_q_loader, (Q, work, sched, lo, hi, q_pre, q_len, qbuf, dbuf, pbuf, lbuf, q_empty,
                         q_ready, kbuf, vbuf, kv_ready, chk_ready, fbuf, stride_qn, h_kv, 0,
                         False, 1)),
        ], [1, 4], [24, 80])
    elif CONS == 1:
        gl.warp_specialize([
            (_consumer, (sched, lo, hi, tok_lo, tok_hi, tok_off, qbuf, dbuf, pbuf, lbuf, kbuf,
                         vbuf, q_empty, q_ready, kv_empty, kv_ready, chk_ready, fbuf, PO, PLSE, K,
                         V, stride_kn, qk_scale, stride_pn, h_kv, SOFTMAX, OVERLAP, CHECK, SMALL,
                         0, 1, 0, 0, STAGES)),
            (_kv_loader, (k_desc, v_desc, work, sched, lo, hi, kbuf, vbuf, kv_empty, kv_ready,
                          h_kv, 0, 1, 0, STAGES)),
            (_q_loader, (Q, work, sched, lo, hi, q_pre, q_len, qbuf, dbuf, pbuf, lbuf, q_empty,
                         q_ready, kbuf, vbuf, kv_ready, chk_ready, fbuf, stride_qn, h_kv, CHECK,
                         SMALL, 1)),
        ], [1, 4], [24, 80])
    else:
        # Two consumers take alternate pairs, each with its loader warp, its two q slots and
        # its STAGES K/V slots.
        gl.warp_specialize([
            (_consumer, (sched, lo, hi, tok_lo, tok_hi, tok_off, qbuf, dbuf, pbuf, lbuf, kbuf,
                         vbuf, q_empty, q_ready, kv_empty, kv_ready, chk_ready, fbuf, PO, PLSE, K,
                         V, stride_kn, qk_scale, stride_pn, h_kv, SOFTMAX, OVERLAP, CHECK, SMALL,
                         0, 2, 0, 0, STAGES)),
            (_kv_loader, (k_desc, v_desc, work, sched, lo, hi, kbuf, vbuf, kv_empty, kv_ready,
                          h_kv, 0, 2, 0, STAGES)),
            (_q_tma_loader, (q_desc, work, sched, lo, hi, q_pre, q_len, qbuf, dbuf, pbuf, lbuf,
                             q_empty, q_ready, h_kv, 2)),
            (_consumer, (sched, lo, hi, tok_lo, tok_hi, tok_off, qbuf, dbuf, pbuf, lbuf, kbuf,
                         vbuf, q_empty, q_ready, kv_empty, kv_ready, chk_ready, fbuf, PO, PLSE, K,
                         V, stride_kn, qk_scale, stride_pn, h_kv, SOFTMAX, OVERLAP, CHECK, SMALL,
                         1, 2, 2, STAGES, STAGES)),
            (_kv_loader, (k_desc, v_desc, work, sched, lo, hi, kbuf, vbuf, kv_empty, kv_ready,
                          h_kv, 1, 2, STAGES, STAGES)),
        ], [1, 1, 4, 1], [24, 48, 232, 24])


def schedule(work: np.ndarray, h_kv: int, programs: int, block_n: int) -> tuple[np.ndarray,
                                                                               np.ndarray]:
    """(work item, KV head) pairs, longest first, each to the least-loaded of ``programs``
    (a pair costs its blocks plus one for its start): the pairs in program order and each
    program's ``[lo, hi)`` in that order, as int32."""
    blocks = -(-(work[:, 1] - work[:, 0]) // block_n) + 1
    pairs = sorted(range(len(work) * h_kv), key=lambda p: -blocks[p // h_kv])
    heap = [(0, i) for i in range(programs)]
    mine: list[list[int]] = [[] for _ in range(programs)]
    for p in pairs:
        load, i = heapq.heappop(heap)
        mine[i].append(p)
        heapq.heappush(heap, (load + int(blocks[p // h_kv]), i))
    order = np.array([p for m in mine for p in m], dtype=np.int32)
    ptr = np.cumsum([0] + [len(m) for m in mine]).astype(np.int32)
    return order, ptr


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, po: torch.Tensor,
           plse: torch.Tensor, arrays: dict, programs: int, block_n: int = 64,
           stages: int = 4, compute: bool = True, softmax: bool = True,
           overlap: bool = False, check: int = 0, small: bool = False, consumers: int = 1,
           compile_only: bool = False) -> object:
    """Partial states of ``q [N, H_q, D]`` over ``k, v [slots, H_kv, D]`` (bf16) into ``po
    [P, H_q, D]`` (fp32) and ``plse [P, H_q]``, for the plan ``arrays`` (device int32:
    work, sched, cta_ptr, tok_lo, tok_hi, tok_off, q_pre, q_len); the other arguments are
    the build's (``BUILDS``)."""
    if consumers == 2 and (check == 1 or small or not compute):
        raise ValueError("two consumers take neither the checker, the small consumer nor "
                         "the streaming-only build")
    if check == 5 and small:
        raise ValueError("the small consumer keeps the per-block checks (check 2)")
    n, h_kv, d = k.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.bfloat16)
    k2, v2 = k.view(n, h_kv * d), v.view(n, h_kv * d)
    kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, d], layout)
    vd = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block_n, d], layout)
    ql = gl.NVMMASharedLayout.get_default_for([M // G, G, d], gl.bfloat16)
    qd = TensorDescriptor(q, list(q.shape), list(q.stride()), [M // G, G, d], ql)
    a = arrays
    args = (q, qd, kd, vd, po, plse, a["work"], a["sched"], a["cta_ptr"], a["tok_lo"],
            a["tok_hi"], a["tok_off"], a["q_pre"], a["q_len"], k2, v2, k2.stride(0),
            d**-0.5 * math.log2(math.e), q.stride(0), po.stride(0), h_kv)
    kw = dict(MR=M, DH=d, BLOCK_N=block_n, STAGES=stages, COMPUTE=compute,
              SOFTMAX=softmax, OVERLAP=overlap, CHECK=check, SMALL=small, CONS=consumers,
              num_warps=4)
    if compile_only:
        return persistent_partial_kernel.warmup(*args, grid=(programs,), **kw)
    return persistent_partial_kernel[(programs,)](*args, **kw)


def _compile_all() -> None:
    from kernel_registers import _Sm90, ptxas_usage
    from triton.runtime import driver

    driver.set_active(_Sm90())
    i32 = torch.zeros(64, dtype=torch.int32)
    arrays = {name: i32 for name in ("work", "sched", "cta_ptr", "tok_lo", "tok_hi", "tok_off",
                                     "q_pre", "q_len")}
    for build in BUILDS:
        q = torch.empty(4, H_Q, D, dtype=torch.bfloat16)
        k = torch.empty(1024, H_KV, D, dtype=torch.bfloat16)
        po = torch.empty(16, H_Q, D)
        plse = torch.empty(16, H_Q)
        built = launch(q, k, k, po, plse, arrays, 132, compile_only=True, **build)
        print(build, ptxas_usage(built.asm["ptx"], None), flush=True)


def _plan_arrays(layout, device: torch.device) -> tuple[dict, int, object]:  # noqa: ANN001
    """The shipped backend's plan of ``layout`` for this device: its device arrays, partial
    states, and kernel config; None where the tree does not qualify (see the top)."""
    from deft.ops.base import Heads
    from deft.ops.triton import backend
    from deft.plan.packing import SEGMENTS

    plan, packed, cfg, _ = backend._pack(
        layout, "flatten", backend.TritonBackend.default_block_kv, Heads(H_Q, H_KV, D), device,
        lambda n: torch.empty(n, dtype=torch.int32), None, None, build="default")
    if not (packed.all_contiguous and packed.sorted_queries):
        return None, 0, cfg
    seg = {name: packed.segment(name) for name in SEGMENTS}
    seg["work"] = packed.work().reshape(-1)
    return seg, plan.num_partials, cfg


def _isolation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shipped: object,
               build: dict, arrays: dict, programs: int, po: torch.Tensor, plse: torch.Tensor,
               o: torch.Tensor, merge: object) -> str:
    """Non-finite values written into three K and three V rows at random slots and heads:
    whether the same output rows come out NaN as from the shipped kernel (whose isolation is
    tested against the reference), and the largest difference on the others."""
    gen = torch.Generator().manual_seed(1)
    slots = torch.randint(0, k.shape[0], (6,), generator=gen).tolist()
    heads = torch.randint(0, k.shape[1], (6,), generator=gen).tolist()
    k, v = k.clone(), v.clone()
    for i, value in enumerate((math.nan, -math.inf, math.inf)):
        k[slots[i], heads[i], 3 * i] = value
        v[slots[3 + i], heads[3 + i], 5 * i] = -value
    ref = shipped.run(q, k, v).float()
    launch(q, k, v, po, plse, arrays, programs, **build)
    merge()
    nan, ref_nan = o.float().isnan().any(-1), ref.isnan().any(-1)
    rest = ~ref_nan
    worst = float((o.float() - ref).abs().amax(-1)[rest].max()) if rest.any() else 0.0
    return (f"NaN rows {'as shipped' if torch.equal(nan, ref_nan) else 'DIFFER'} "
            f"({int(ref_nan.sum())} of {ref_nan.numel()}), others {worst:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="*", metavar="TREE", help=f"default: {DEFAULT_TREES}")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--builds", help="comma-separated indices into BUILDS (default: all)")
    args = ap.parse_args()
    chosen = ([BUILDS[int(i)] for i in args.builds.split(",")] if args.builds else BUILDS)
    if args.compile_only:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        _compile_all()
        return
    from benchmarks.attention_gpu import random_inputs, time_us
    from benchmarks.trees import available
    from deft import TreeAttention
    from deft.ops.base import Capacity
    from deft.ops.triton.launch import launch_merge
    from deft.recorded import workloads_dir

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print("| tree | build | partial µs/step | with merge | shipped one plan | shipped graph-safe "
          "| max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, layout in available(args.trees or DEFAULT_TREES, workloads_dir(None)):
        seg, partials, cfg = _plan_arrays(layout, dev)
        if seg is None:
            print(f"| {name} | gathered slots or unsorted queries: skipped | | | | | |")
            continue
        n, nq = layout.num_tokens, layout.num_queries
        ks, vs, q = random_inputs(n, nq)
        shipped = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda")
        shipped.plan(layout)
        safe = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda",
                             capacity=Capacity(nq, n))
        safe.plan(layout)
        ref = shipped.run(q, ks[0], vs[0]).float()
        us_one = time_us(lambda: [shipped.run(q, ks[i], vs[i]) for i in range(LAYERS)], True)
        us_safe = time_us(lambda: [safe.run(q, ks[i], vs[i]) for i in range(LAYERS)], True)
        work = seg["work"].reshape(-1, 8)
        for build in chosen:
            order, ptr = schedule(work, H_KV, min(sms, len(work) * H_KV), build["block_n"])
            arrays = {name_: torch.from_numpy(np.ascontiguousarray(x)).to(dev) for name_, x in (
                ("work", seg["work"]), ("sched", order), ("cta_ptr", ptr),
                ("tok_lo", seg["tok_lo"]), ("tok_hi", seg["tok_hi"]), ("tok_off", seg["tok_off"]),
                ("q_pre", seg["q_pre"]), ("q_len", seg["q_len"]))}
            indptr = torch.from_numpy(seg["merge_indptr"].copy()).to(dev)
            indices = torch.from_numpy(seg["merge_partials"].copy()).to(dev)
            po = torch.zeros(max(partials, 1), H_Q, D, device=dev)
            plse = torch.zeros(max(partials, 1), H_Q, device=dev)
            o = torch.empty(nq, H_Q, D, device=dev, dtype=torch.bfloat16)
            lse = torch.empty(nq, H_Q, device=dev)
            programs = len(ptr) - 1

            def partial(i: int, build: dict = build) -> None:
                launch(q, ks[i], vs[i], po, plse, arrays, programs, **build)

            def merge() -> None:
                launch_merge(po, plse, o, lse, indptr, indices, block=cfg.merge_block,
                             warps=cfg.merge_warps, heads=cfg.merge_heads)

            partial(0)
            merge()
            diff = (f"{float((o.float() - ref).abs().max()):.2e}"
                    if build.get("compute", True) and build.get("softmax", True) else "- (timing)")
            if build.get("check", 0) in (1, 2, 3, 5):
                diff += "; " + _isolation(q, ks[0], vs[0], shipped, build, arrays, programs, po,
                                          plse, o, merge)
            us_p = time_us(lambda: [partial(i) for i in range(LAYERS)], True)
            us_m = time_us(lambda: [(partial(i), merge()) for i in range(LAYERS)], True)
            print(f"| {name} | {build} | {us_p:,.0f} | {us_m:,.0f} | {us_one:,.0f} "
                  f"| {us_safe:,.0f} | {diff} |", flush=True)


if __name__ == "__main__":
    main()
