"""Triton kernels of the ``triton`` backend (``@triton.jit`` code only; launchers live in
``launch.py``).

``tree_partial_kernel``: one program per (work item, KV head), KV heads varying fastest. A
work item is a query-row chunk of one tile: rows are (group query, GQA head) pairs, so every
query head that shares the KV head is computed from the same K/V loads. The program streams
the tile's tokens in blocks of ``BLOCK_N`` (K/V copies in flight ahead of use; by TMA when
the tile's slots are consecutive and the launcher passes tensor descriptors), applies the
plan's compact visibility mask from the tile's ``mask_from`` on, keeps an online softmax,
and writes one partial state per (query, head): ``o`` in ``PO``'s dtype (q's for
fp16/bf16), ``lse`` in fp32. With ``FUSE_MERGE`` the program that writes a row's last
partial state also merges the row (off by default: slower; see docs/decisions.md).

K/V of another dtype than q (FP8: one byte per element read) convert exactly to q's dtype as
they are loaded; with ``SCALED``, the head's K scale multiplies the score scale and its V
scale the output, so the result is attention over the dequantised K/V, with no rounding
added beyond what the dots' dtype adds to unscaled K/V. ``F16_DOTS`` (a bf16 q over one-byte
K/V): q is converted to fp16 once instead (see ``fp16_queries``) and K/V to fp16 as loaded,
which sm_90 does natively for e4m3 where bf16 takes a scalar conversion per element; every
e4m3 value is an fp16 value, and probabilities round to fp16, finer than bf16 on [0, 1].

Non-finite K/V stay with the rows that see them, with checks only on values already in
registers. A non-finite K row makes the score of every row that sees it non-finite: NaN and
+inf scores make the row's state NaN by themselves, a -inf score (which would silently drop
the token) becomes NaN first; masked scores are selected to -inf, so none of it reaches a
row that cannot see it. In a masked block, where some rows may not see some token,
non-finite V values are zeroed before ``p @ V`` (a probability of 0 times NaN is NaN) and
the probabilities of the rows that see them made NaN; in the other blocks every row sees
every token, so a non-finite V row reaches exactly the rows that see it (a TMA box's rows
past its tile, seen by none, are zeroed). The epilogue makes a row with a non-finite output
NaN (o and lse; under ``ACC_CHECK``, the lse alone, which every merge turns into a NaN row;
``SUMS`` finds such rows by their sums). Two more flags make this cheaper (the sm90 configs
take both, the first over e4m3 K, the second over 16-bit K/V; they also take ``ACC_CHECK``,
``SUMS`` over 16-bit K/V, and ``INF_K`` 2 where K may hold infinities; docs/decisions.md):
``INF_K`` 0 (e4m3 K, which holds no infinities, under a 16-bit q, whose products cannot
overflow fp32: no score is -inf) skips the -inf select (``INF_K`` 2 replaces it with an FMA
in the unmasked blocks: :func:`softmax_step`); ``DEFER_V`` leaves V's values
unchecked in the masked blocks (none loaded from shared memory, tested and stored back):
one non-finite V value makes its column of every row's accumulator non-finite (0 * NaN is
NaN, and NaN and inf persist through the online softmax), so a work item whose state comes
out finite loaded none, and one that does not is computed again with the checks.

``D`` is the head dim rounded up to a power of two (Triton's blocks), ``HEAD_D`` the head's
own: where they differ (Phi-3's 96 in blocks of 128), q and K/V load their padding columns
as 0, which adds 0 to every score and output column, and only the head's columns are
stored; such heads load gathered (a TMA box would take the next head's columns).

The merge of partial states (its own launch, or fused: ``merge_if_last``) lives in
``merge_kernels.py``.
"""

import types

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ...plan.visibility import visible
from ..columns import head_cols
from .merge_kernels import merge_if_last
from .softmax import (accumulate, bad_rows, bad_rows_by_sum, finite, fp16_queries, no_neg_inf,
                      scores, softmax_step)

# The planner's predicate, compiled with this module's globals (Triton resolves names there).
_visible = triton.jit(types.FunctionType(visible.__code__, globals(), "visible"))


@triton.jit
def _tile_loop(
    q, K, V, tok_slot, tok_lo, tok_hi, tok_off, tok0, tok1, seen_to, slot0, kvh, pre, qlen,
    row_ok, m_i, l_i, acc, qk_scale, stride_kn, stride_kh,
    D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CONTIG: tl.constexpr,
    IEEE: tl.constexpr, ALIGN_MASK: tl.constexpr, INF_K: tl.constexpr, CHECK_V: tl.constexpr,
    HEAD_D: tl.constexpr,
):
    """Online softmax of the query rows over plan tokens ``[tok0, tok1)``, ``BLOCK_N`` at a time.

    ``CONTIG``: the tokens sit in consecutive slots from ``slot0``, so K/V addresses need no
    slot load. Otherwise the next block's slots are loaded one iteration ahead, so the K/V
    loads of a block never wait on a slot load of the same iteration. ``MASKED`` with
    ``ALIGN_MASK``: every row sees the tokens before ``seen_to`` (see :func:`_work_item`).
    """
    d = tl.arange(0, D)
    if not CONTIG:
        first = tok0 + tl.arange(0, BLOCK_N)
        next_slot = tl.load(tok_slot + first, mask=first < tok1, other=0)
    for start in range(tok0, tok1, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        tok_ok = offs < tok1
        if CONTIG:
            slot = (slot0 - tok0 + offs).to(tl.int64)
        else:
            slot = next_slot.to(tl.int64)
            ahead = offs + BLOCK_N
            next_slot = tl.load(tok_slot + ahead, mask=ahead < tok1, other=0)
        kv_off = slot[:, None] * stride_kn + kvh * stride_kh + d[None, :]
        kv_ok = head_cols(tok_ok[:, None], d[None, :], HEAD_D, D)
        k = tl.load(K + kv_off, mask=kv_ok, other=0.0).to(q.dtype)
        s = scores(q, k, IEEE)
        vis = tok_ok[None, :] & row_ok[:, None]
        if MASKED:
            lo = tl.load(tok_lo + offs, mask=tok_ok, other=0)
            hi = tl.load(tok_hi + offs, mask=tok_ok, other=0)
            off = tl.load(tok_off + offs, mask=tok_ok, other=0)
            vis = vis & _visible(pre[:, None], qlen[:, None], lo[None, :], hi[None, :], off[None, :])
            if ALIGN_MASK:  # every row sees the tokens before seen_to (see _work_item)
                vis = vis | ((offs < seen_to)[None, :] & row_ok[:, None])
        s_raw = s  # padding tokens' K loads as 0: no raw score of theirs is non-finite
        if INF_K == 1 or (INF_K and MASKED):
            s = no_neg_inf(s)
        s = tl.where(vis, s, float("-inf"))
        p, m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, qk_scale, s_raw,
                                        RAW_INF=INF_K == 2 and not MASKED)
        v = tl.load(V + kv_off, mask=kv_ok, other=0.0).to(q.dtype)
        if MASKED and CHECK_V:  # padding loads as 0; unmasked blocks need none (see the top)
            p = tl.where(vis & (bad_rows(v)[None, :] > 0), float("nan"), p)
            v = tl.where(finite(v), v, 0.0)
        acc = accumulate(p, v, acc, IEEE)
    return m_i, l_i, acc


@triton.jit
def _tma_block(
    q, desc_k, desc_v, tok_lo, tok_hi, tok_off, start, tok1, seen_to, slot, kvh, pre, qlen,
    m_i, l_i, acc, qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    TAIL: tl.constexpr, IEEE: tl.constexpr, ALIGN_MASK: tl.constexpr,
    RANGES_FIRST: tl.constexpr,
    INF_K: tl.constexpr, CHECK_V: tl.constexpr,
):
    """One online-softmax step over the ``BLOCK_N`` consecutive slots from ``slot``, loaded
    by TMA. ``TAIL``: only tokens before ``tok1`` count; the box's rows past it (another
    node's KV, or unwritten cache) are masked out of the scores and their V rows zeroed (but
    where ``CHECK_V`` has a masked tail check them), so their K/V never flag a row nor make
    a work item be computed again. ``MASKED``: the rows see the tokens by
    their node ranges, loaded before K's (``RANGES_FIRST``: in flight while K's load is
    waited for, where the block is not software-pipelined) or after its product."""
    if MASKED and RANGES_FIRST:
        offs = start + tl.arange(0, BLOCK_N)
        tok_ok = offs < tok1
        lo = tl.load(tok_lo + offs, mask=tok_ok, other=0)
        hi = tl.load(tok_hi + offs, mask=tok_ok, other=0)
        off = tl.load(tok_off + offs, mask=tok_ok, other=0)
    k = desc_k.load([slot, kvh * D]).to(q.dtype)
    s = scores(q, k, IEEE)
    if MASKED or TAIL:
        if not (MASKED and RANGES_FIRST):
            offs = start + tl.arange(0, BLOCK_N)
            tok_ok = offs < tok1
        if MASKED:
            if not RANGES_FIRST:
                lo = tl.load(tok_lo + offs, mask=tok_ok, other=0)
                hi = tl.load(tok_hi + offs, mask=tok_ok, other=0)
                off = tl.load(tok_off + offs, mask=tok_ok, other=0)
            vis = _visible(pre[:, None], qlen[:, None], lo[None, :], hi[None, :], off[None, :])
            if ALIGN_MASK:  # every row sees the tokens before seen_to (see _work_item)
                vis = vis | (offs < seen_to)[None, :]
            vis = vis & tok_ok[None, :]
        else:
            vis = tok_ok[None, :]
        if INF_K:
            s = no_neg_inf(s)
        s = tl.where(vis, s, float("-inf"))
    elif INF_K == 1:
        s = no_neg_inf(s)
    p, m_i, l_i, acc = softmax_step(s, m_i, l_i, acc, qk_scale, s,
                                    RAW_INF=INF_K == 2 and not (MASKED or TAIL))
    v = desc_v.load([slot, kvh * D]).to(q.dtype)
    if MASKED and CHECK_V:  # unmasked blocks need no V check (see the top)
        p = tl.where(vis & (bad_rows(v)[None, :] > 0), float("nan"), p)
        v = tl.where(finite(v), v, 0.0)
    elif TAIL:  # every row sees the tokens before tok1 (see the top), none those past it
        v = tl.where(tok_ok[:, None], v, 0.0)
    acc = accumulate(p, v, acc, IEEE)
    return m_i, l_i, acc


@triton.jit
def _tma_tile(
    q, desc_k, desc_v, tok_lo, tok_hi, tok_off, tok0, tok1, seen_to, slot0, kvh, pre, qlen,
    m_i, l_i, acc, qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    IEEE: tl.constexpr, ALIGN_MASK: tl.constexpr, RANGES_FIRST: tl.constexpr,
    INF_K: tl.constexpr, CHECK_V: tl.constexpr,
):
    """``_tile_loop`` for a tile of consecutive slots from ``slot0``, every block by TMA: no
    per-element addresses, masks or slot loads, which frees registers and issue slots."""
    whole = tok0 + (tok1 - tok0) // BLOCK_N * BLOCK_N
    for start in range(tok0, whole, BLOCK_N):
        m_i, l_i, acc = _tma_block(
            q, desc_k, desc_v, tok_lo, tok_hi, tok_off, start, tok1, seen_to,
            slot0 + (start - tok0), kvh, pre, qlen, m_i, l_i, acc, qk_scale, D=D,
            BLOCK_N=BLOCK_N, MASKED=MASKED, TAIL=False, IEEE=IEEE, ALIGN_MASK=ALIGN_MASK,
            RANGES_FIRST=RANGES_FIRST, INF_K=INF_K, CHECK_V=CHECK_V)
    if whole < tok1:
        m_i, l_i, acc = _tma_block(
            q, desc_k, desc_v, tok_lo, tok_hi, tok_off, whole, tok1, seen_to,
            slot0 + (whole - tok0), kvh, pre, qlen, m_i, l_i, acc, qk_scale, D=D,
            BLOCK_N=BLOCK_N, MASKED=MASKED, TAIL=True, IEEE=IEEE, ALIGN_MASK=ALIGN_MASK,
            RANGES_FIRST=RANGES_FIRST, INF_K=INF_K, CHECK_V=CHECK_V)
    return m_i, l_i, acc


@triton.jit
def _tile(
    q, K, V, desc_k, desc_v, tok_slot, tok_lo, tok_hi, tok_off, tok0, tok1, seen_to, slot0,
    kvh, pre, qlen, row_ok, m_i, l_i, acc, qk_scale, stride_kn, stride_kh,
    D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CONTIG: tl.constexpr,
    TMA: tl.constexpr, IEEE: tl.constexpr, ALIGN_MASK: tl.constexpr,
    RANGES_FIRST: tl.constexpr,
    INF_K: tl.constexpr, CHECK_V: tl.constexpr, HEAD_D: tl.constexpr,
):
    """The tile's online softmax. ``TMA``: a tile of consecutive slots (``slot0 >= 0``; all
    tiles when ``CONTIG``) loads by TMA, any other by gathered loads."""
    if TMA and (CONTIG or slot0 >= 0):
        tl.static_assert(HEAD_D == D, "a TMA box is a whole head: padded heads load gathered")
        m_i, l_i, acc = _tma_tile(
            q, desc_k, desc_v, tok_lo, tok_hi, tok_off, tok0, tok1, seen_to, slot0, kvh, pre,
            qlen, m_i, l_i, acc, qk_scale, D=D, BLOCK_N=BLOCK_N, MASKED=MASKED, IEEE=IEEE,
            ALIGN_MASK=ALIGN_MASK, RANGES_FIRST=RANGES_FIRST, INF_K=INF_K,
            CHECK_V=CHECK_V)
    else:
        m_i, l_i, acc = _tile_loop(
            q, K, V, tok_slot, tok_lo, tok_hi, tok_off, tok0, tok1, seen_to, slot0, kvh, pre,
            qlen, row_ok, m_i, l_i, acc, qk_scale, stride_kn, stride_kh,
            D=D, BLOCK_N=BLOCK_N, MASKED=MASKED, CONTIG=CONTIG, IEEE=IEEE,
            ALIGN_MASK=ALIGN_MASK, INF_K=INF_K, CHECK_V=CHECK_V, HEAD_D=HEAD_D)
    return m_i, l_i, acc


@triton.jit
def plan_header(plan):
    """A graph-safe plan's work-item count and segment offsets (token lo, hi, off; work
    items; query order, pre, len), from the 16 ints before its first segment."""
    return (tl.load(plan - 16), tl.load(plan - 15), tl.load(plan - 14), tl.load(plan - 13),
            tl.load(plan - 12), tl.load(plan - 11), tl.load(plan - 10), tl.load(plan - 9))


@triton.jit
def tree_partial_kernel(
    Q, K, V, desc_k, desc_v, PO, PLSE,
    plan,  # the packed int32 plan; its first segment is the token slots
    # Where its other segments start (multiples of 16): token lo, hi, off; the work items,
    # [W, 8] per program: tok0, tok1, qs, qe, p0, mask_from, slot0, row0; query order, pre,
    # len. Offsets rather than pointers: a plan makes fewer pointer objects on the host.
    off_lo, off_hi, off_off, off_work, off_order, off_pre, off_len,
    O, LSE, counts, merge_indptr, merge_partials,
    qk_scale,  # sm_scale * log2(e)
    stride_qn, stride_qh, stride_kn, stride_kh, stride_pn, stride_ph, stride_ln,
    stride_on, stride_oh, num_heads,
    KS, VS, stride_s,  # K and V dequantisation scales, [1] (stride 0) or [H_kv]; SCALED only
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_MASK: tl.constexpr, CONTIG: tl.constexpr, TMA: tl.constexpr, SORTED: tl.constexpr,
    FUSE_MERGE: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, HEADER: tl.constexpr,
    SCALED: tl.constexpr, F16_DOTS: tl.constexpr, ALIGN_MASK: tl.constexpr,
    RANGES_FIRST: tl.constexpr,
    INF_K: tl.constexpr, DEFER_V: tl.constexpr, IN_ORDER: tl.constexpr, EARLY: tl.constexpr,
    SUMS: tl.constexpr, ACC_CHECK: tl.constexpr, HEAD_D: tl.constexpr,
):
    # KV heads vary fastest: programs start in work-item order (largest tiles first) across
    # all heads, so the launch's last programs are its shortest ones.
    h_kv = num_heads // G
    if HEADER:
        # Graph-safe launches: the grid is fixed (``graph_waves`` waves of programs), each
        # program takes the (work item, KV head) pairs ``pid, pid + grid, ...`` of the
        # current plan, whose count and segment offsets come from the 16 ints before its
        # first segment, so no launch argument changes between plans. A grid of more than
        # one wave leaves the hardware to hand most pairs to the SMs that finish first.
        num_work, off_lo, off_hi, off_off, off_work, off_order, off_pre, off_len = (
            plan_header(plan))
        # IN_ORDER: the header's 11th int says whether the plan's queries are in plan order.
        in_order = tl.load(plan - 6) if IN_ORDER else 0
        total = num_work * h_kv
        pid = tl.program_id(0)
        # The first pair waits for the previous launch once described, as below; a program
        # without one still waits (so the launch ends after the previous one).
        if pid < total:
            _work_item(
                pid // h_kv, pid % h_kv, Q, K, V, desc_k, desc_v, PO, PLSE, plan, off_lo,
                off_hi, off_off, off_work, off_order, off_pre, off_len, O, LSE, counts,
                merge_indptr, merge_partials, qk_scale, stride_qn, stride_qh, stride_kn,
                stride_kh, stride_pn, stride_ph, stride_ln, stride_on, stride_oh, num_heads,
                KS, VS, stride_s, in_order, G=G, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                USE_MASK=USE_MASK, CONTIG=CONTIG, TMA=TMA, SORTED=SORTED,
                FUSE_MERGE=FUSE_MERGE, IEEE=IEEE, WAIT=PDL, SCALED=SCALED, F16_DOTS=F16_DOTS,
                ALIGN_MASK=ALIGN_MASK, RANGES_FIRST=RANGES_FIRST, INF_K=INF_K,
                DEFER_V=DEFER_V, IN_ORDER=IN_ORDER, EARLY=EARLY, SUMS=SUMS,
                ACC_CHECK=ACC_CHECK, HEAD_D=HEAD_D)
        else:
            if PDL:
                gdc_launch_dependents()
                gdc_wait()
        for item in range(pid + tl.num_programs(0), total, tl.num_programs(0)):
            _work_item(
                item // h_kv, item % h_kv, Q, K, V, desc_k, desc_v, PO, PLSE, plan, off_lo,
                off_hi, off_off, off_work, off_order, off_pre, off_len, O, LSE, counts,
                merge_indptr, merge_partials, qk_scale, stride_qn, stride_qh, stride_kn,
                stride_kh, stride_pn, stride_ph, stride_ln, stride_on, stride_oh, num_heads,
                KS, VS, stride_s, in_order, G=G, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                USE_MASK=USE_MASK, CONTIG=CONTIG, TMA=TMA, SORTED=SORTED,
                FUSE_MERGE=FUSE_MERGE, IEEE=IEEE, WAIT=False, SCALED=SCALED, F16_DOTS=F16_DOTS,
                ALIGN_MASK=ALIGN_MASK, RANGES_FIRST=RANGES_FIRST, INF_K=INF_K,
                DEFER_V=DEFER_V, IN_ORDER=IN_ORDER, EARLY=EARLY, SUMS=SUMS,
                ACC_CHECK=ACC_CHECK, HEAD_D=HEAD_D)
    else:
        _work_item(
            tl.program_id(0) // h_kv, tl.program_id(0) % h_kv, Q, K, V, desc_k, desc_v, PO,
            PLSE, plan, off_lo, off_hi, off_off, off_work, off_order, off_pre, off_len, O, LSE,
            counts, merge_indptr, merge_partials, qk_scale, stride_qn, stride_qh, stride_kn,
            stride_kh, stride_pn, stride_ph, stride_ln, stride_on, stride_oh, num_heads,
            KS, VS, stride_s, 0, G=G, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            USE_MASK=USE_MASK, CONTIG=CONTIG, TMA=TMA, SORTED=SORTED, FUSE_MERGE=FUSE_MERGE,
            IEEE=IEEE, WAIT=PDL, SCALED=SCALED, F16_DOTS=F16_DOTS, ALIGN_MASK=ALIGN_MASK,
            RANGES_FIRST=RANGES_FIRST, INF_K=INF_K, DEFER_V=DEFER_V, IN_ORDER=False,
            EARLY=EARLY, SUMS=SUMS, ACC_CHECK=ACC_CHECK, HEAD_D=HEAD_D)


@triton.jit
def _item_state(
    q, K, V, desc_k, desc_v, tok_slot, tok_lo, tok_hi, tok_off, tok0, tok1, mask_from, slot0,
    kvh, pre, qlen, row_ok, qk_scale, stride_kn, stride_kh,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_MASK: tl.constexpr,
    CONTIG: tl.constexpr, TMA: tl.constexpr, IEEE: tl.constexpr, ALIGN_MASK: tl.constexpr,
    RANGES_FIRST: tl.constexpr, INF_K: tl.constexpr, CHECK_V: tl.constexpr,
    HEAD_D: tl.constexpr,
):
    """A work item's online-softmax state (running max, sum, accumulator) over its tile.
    ``CHECK_V``: masked blocks check V's values (see the top)."""
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # Two loops, each branch-free and pipelined: unmasked tokens, then masked ones from
    # ``split`` on (``mask_from``, or with ALIGN_MASK the block boundary at or before it).
    split = mask_from
    if ALIGN_MASK:
        if mask_from < tok1:
            split = tok0 + (mask_from - tok0) // BLOCK_N * BLOCK_N
    if tok0 < split:
        m_i, l_i, acc = _tile(
            q, K, V, desc_k, desc_v, tok_slot, tok_lo, tok_hi, tok_off, tok0, split, split,
            slot0, kvh, pre, qlen, row_ok, m_i, l_i, acc, qk_scale, stride_kn, stride_kh,
            D=D, BLOCK_N=BLOCK_N, MASKED=False, CONTIG=CONTIG, TMA=TMA, IEEE=IEEE,
            ALIGN_MASK=ALIGN_MASK, RANGES_FIRST=RANGES_FIRST, INF_K=INF_K, CHECK_V=CHECK_V,
            HEAD_D=HEAD_D)
    if USE_MASK:
        if split < tok1:
            slot_m = tl.where(slot0 >= 0, slot0 + (split - tok0), -1)
            m_i, l_i, acc = _tile(
                q, K, V, desc_k, desc_v, tok_slot, tok_lo, tok_hi, tok_off, split, tok1,
                mask_from, slot_m, kvh, pre, qlen, row_ok, m_i, l_i, acc, qk_scale, stride_kn,
                stride_kh, D=D, BLOCK_N=BLOCK_N, MASKED=True, CONTIG=CONTIG, TMA=TMA,
                IEEE=IEEE, ALIGN_MASK=ALIGN_MASK, RANGES_FIRST=RANGES_FIRST, INF_K=INF_K,
                CHECK_V=CHECK_V, HEAD_D=HEAD_D)
    return m_i, l_i, acc


@triton.jit
def _item_rows(row0, qs, qe, kvh, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Which of a work item's rows (from ``row0``) hold a query, and each row's query within
    the item's group, query head and plan position."""
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < (qe - qs) * G
    qi = rows // G  # query index within the group
    head = kvh * G + rows % G
    return row_ok, qi, head, qs + qi


@triton.jit
def _query_rows(q_order, qpos, row_ok, in_order, SORTED: tl.constexpr, IN_ORDER: tl.constexpr):
    """The Q row of each plan position ``qpos``: itself where the queries are in plan order
    (``SORTED``, or ``IN_ORDER`` with ``in_order`` set: no load), else its query order."""
    if SORTED:
        qorig = qpos.to(tl.int64)
    elif IN_ORDER:
        if in_order != 0:
            qorig = qpos.to(tl.int64)
        else:
            qorig = tl.load(q_order + qpos, mask=row_ok, other=0).to(tl.int64)
    else:
        qorig = tl.load(q_order + qpos, mask=row_ok, other=0).to(tl.int64)
    return qorig


@triton.jit
def _work_item(
    w, kvh, Q, K, V, desc_k, desc_v, PO, PLSE, plan, off_lo, off_hi, off_off, off_work,
    off_order, off_pre, off_len, O, LSE, counts, merge_indptr, merge_partials, qk_scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_pn, stride_ph, stride_ln,
    stride_on, stride_oh, num_heads, KS, VS, stride_s, in_order,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_MASK: tl.constexpr, CONTIG: tl.constexpr, TMA: tl.constexpr, SORTED: tl.constexpr,
    FUSE_MERGE: tl.constexpr, IEEE: tl.constexpr, WAIT: tl.constexpr, SCALED: tl.constexpr,
    F16_DOTS: tl.constexpr, ALIGN_MASK: tl.constexpr, RANGES_FIRST: tl.constexpr,
    INF_K: tl.constexpr, DEFER_V: tl.constexpr, IN_ORDER: tl.constexpr, EARLY: tl.constexpr,
    SUMS: tl.constexpr, ACC_CHECK: tl.constexpr, HEAD_D: tl.constexpr,
):
    """Work item ``w`` of the plan for KV head ``kvh``: its partial states. ``WAIT``: wait
    for the previous launch (programmatic dependent launch) once the item is described
    (``EARLY``: once its queries' order, prefixes and lengths are loaded too). ``IN_ORDER``:
    where ``in_order`` (the plan header's) is set, the queries are in plan order, so their Q
    rows need no query-order load, as with ``SORTED``.
    ``SCALED``: K/V (e.g. FP8, converted exactly to the dots' dtype as loaded) are dequantised
    by the head's scales: K's folds into the score scale, V's into the epilogue.
    ``F16_DOTS``: the dots run in fp16 (see the top). ``INF_K``, ``DEFER_V``: see the top.
    ``ALIGN_MASK``: the masked part of a tile starts at the block boundary at or before its
    ``mask_from``, so that the unmasked part has no partial last block (run outside the
    pipelined loop); every row sees the tokens between the two, whatever ranges the planner
    left there (the compiled planner writes them only from the node segment that holds
    ``mask_from``). ``RANGES_FIRST``: see :func:`_tma_block`. ``SUMS``: the item's end finds
    its non-finite rows by their sums (:func:`bad_rows_by_sum`). ``ACC_CHECK``: it checks
    the accumulator's rows once (the deferred V checks' test, reused) instead of the
    output's, and marks a bad row by its lse alone (no select of its o)."""
    tok_slot = plan
    tok_lo = plan + off_lo
    tok_hi = plan + off_hi
    tok_off = plan + off_off
    q_order = plan + off_order
    q_pre = plan + off_pre
    q_len = plan + off_len
    # One row of independent loads (one memory round trip) describes the program's work.
    desc = plan + off_work + w * 8
    tok0 = tl.load(desc)
    tok1 = tl.load(desc + 1)
    qs = tl.load(desc + 2)
    qe = tl.load(desc + 3)
    p0 = tl.load(desc + 4)
    # Every group query sees the tile's tokens before mask_from: no per-token mask there
    # (most prompt tiles, and the bulk of a coarsened tile that ends in partly seen tokens).
    mask_from = tl.load(desc + 5) if USE_MASK else tok1
    # slot0 >= 0: the tile's slots are consecutive from slot0. CONTIG: every tile's are (no
    # slot loads at all).
    slot0 = tl.load(desc + 6) if CONTIG or TMA else 0
    row0 = tl.load(desc + 7)
    if EARLY:
        row_ok, qi, head, qpos = _item_rows(row0, qs, qe, kvh, G=G, BLOCK_M=BLOCK_M)
        qorig = _query_rows(q_order, qpos, row_ok, in_order, SORTED=SORTED, IN_ORDER=IN_ORDER)
        pre = tl.load(q_pre + qpos, mask=row_ok, other=-1)
        qlen = tl.load(q_len + qpos, mask=row_ok, other=0)
    if WAIT:
        # The plan arrays above come from a stream-ordered upload (PDL does not overlap a
        # copy); Q and the partial workspace (read by the previous launch's merge) wait for
        # the previous launch. Every program waits, with no return before: so this launch
        # ends after the previous one, and the next launch's wait covers both.
        gdc_launch_dependents()
        gdc_wait()

    if not EARLY:
        row_ok, qi, head, qpos = _item_rows(row0, qs, qe, kvh, G=G, BLOCK_M=BLOCK_M)
        qorig = _query_rows(q_order, qpos, row_ok, in_order, SORTED=SORTED, IN_ORDER=IN_ORDER)
    d = tl.arange(0, D)
    q = tl.load(Q + qorig[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=head_cols(row_ok[:, None], d[None, :], HEAD_D, D), other=0.0)
    if not EARLY:
        pre = tl.load(q_pre + qpos, mask=row_ok, other=-1)
        qlen = tl.load(q_len + qpos, mask=row_ok, other=0)

    v_s = 1.0
    if SCALED:
        qk_scale = qk_scale * tl.load(KS + kvh * stride_s)
        v_s = tl.load(VS + kvh * stride_s)
    if F16_DOTS:
        q, qk_scale = fp16_queries(q, qk_scale)
    m_i, l_i, acc = _item_state(
        q, K, V, desc_k, desc_v, tok_slot, tok_lo, tok_hi, tok_off, tok0, tok1, mask_from, slot0,
        kvh, pre, qlen, row_ok, qk_scale, stride_kn, stride_kh, D=D, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, USE_MASK=USE_MASK, CONTIG=CONTIG, TMA=TMA, IEEE=IEEE,
        ALIGN_MASK=ALIGN_MASK, RANGES_FIRST=RANGES_FIRST, INF_K=INF_K, CHECK_V=not DEFER_V,
        HEAD_D=HEAD_D)
    if DEFER_V:
        # A row may have taken a NaN/inf V row that it does not see (0 * NaN). Non-finite
        # values persist, so a state without them proves that none did; else the item is
        # computed again with V's checks, by gathered loads (so each call site of this
        # function adds one copy of the loops, not two).
        bad = bad_rows_by_sum(acc, SUMS)
        if tl.max(bad, 0) > 0:
            m_i, l_i, acc = _item_state(
                q, K, V, desc_k, desc_v, tok_slot, tok_lo, tok_hi, tok_off, tok0, tok1,
                mask_from, slot0, kvh, pre, qlen, row_ok, qk_scale, stride_kn, stride_kh, D=D,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, USE_MASK=USE_MASK, CONTIG=CONTIG, TMA=False,
                IEEE=IEEE, ALIGN_MASK=ALIGN_MASK, RANGES_FIRST=RANGES_FIRST, INF_K=INF_K,
                CHECK_V=True, HEAD_D=HEAD_D)
            if ACC_CHECK:
                bad = bad_rows_by_sum(acc, SUMS)
    elif ACC_CHECK:
        bad = bad_rows_by_sum(acc, SUMS)

    has = l_i > 0
    o = acc * (v_s / tl.where(has, l_i, 1.0))[:, None]
    # Natural-log lse from the base-2 running max and sum.
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    if not ACC_CHECK:
        bad = bad_rows_by_sum(o, SUMS)  # the row saw a non-finite K/V row
        o = tl.where(bad[:, None] > 0, float("nan"), o)
    # ACC_CHECK: a row saw a non-finite K/V row exactly when its accumulator is not finite
    # (a NaN probability reaches the accumulator too), and a NaN lse alone marks its state:
    # every merge makes the row of such a state NaN, whatever its o.
    lse = tl.where(bad > 0, float("nan"), lse)
    pid = (p0 + qi).to(tl.int64)
    tl.store(PO + pid[:, None] * stride_pn + head[:, None] * stride_ph + d[None, :],
             o.to(PO.dtype.element_ty), mask=head_cols(row_ok[:, None], d[None, :], HEAD_D, D))
    tl.store(PLSE + pid * stride_ln + head, lse, mask=row_ok)
    if FUSE_MERGE:
        merge_if_last(PO, PLSE, O, LSE, counts, merge_indptr, merge_partials, qorig, head,
                      row_ok, stride_pn, stride_ph, stride_ln, stride_on, stride_oh, num_heads,
                      D=D, HEAD_D=HEAD_D)
