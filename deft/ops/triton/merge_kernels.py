"""Triton kernels that merge partial attention states (``@triton.jit`` code only; launchers
live in ``launch.py``).

``merge_kernel``: one program per (query, block of heads); merges the query's partial states
through the reduction map (CSR), a block of them per step, into ``o`` (output dtype) and
``lse`` (natural log). A state with an ``lse`` of NaN or +inf makes its row NaN.

``D`` is the head dim rounded up to a power of two, ``HEAD_D`` the head's own (see
:func:`deft.ops.columns.head_cols`).

``merge_if_last``: the fused merge, called by ``kernels.tree_partial_kernel`` with
``FUSE_MERGE``: the program that writes a row's last partial state merges the row.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..columns import head_cols


@triton.jit
def _merged(acc, den, m, invalid):
    """A merged row's output and natural-log lse from its running accumulator, sum and max;
    both NaN where ``invalid`` (some state's lse was NaN or +inf), -inf lse where no state
    saw a token."""
    has = den > 0
    bad = invalid > 0
    out = tl.where(bad[:, None], float("nan"), acc / tl.where(has, den, 1.0)[:, None])
    lse = tl.where(bad, float("nan"), tl.where(has, m + tl.log(tl.where(has, den, 1.0)),
                                                float("-inf")))
    return out, lse


@triton.jit
def merge_if_last(
    PO, PLSE, O, LSE, counts, merge_indptr, merge_partials, qorig, head, row_ok,
    stride_pn, stride_ph, stride_ln, stride_on, stride_oh, num_heads, D: tl.constexpr,
    HEAD_D: tl.constexpr,
):
    """Count this program's partial states per (query, head); the program that writes the
    last one of a row merges that row's states into ``O``/``LSE`` and resets its count.

    The count is a semaphore, not a reduction: each row is merged once, by one program, in
    the reduction map's order, so results do not depend on which program finishes last.
    """
    cidx = qorig * num_heads + head
    tl.debug_barrier()  # every thread's partial stores precede the release below
    prev = tl.atomic_add(counts + cidx, 1, mask=row_ok, sem="acq_rel")
    start = tl.load(merge_indptr + qorig, mask=row_ok, other=0)
    end = tl.load(merge_indptr + qorig + 1, mask=row_ok, other=0)
    last = row_ok & (prev + 1 == end - start)
    if tl.sum(last.to(tl.int32), 0) > 0:
        tl.debug_barrier()  # the acquire above precedes every thread's loads below
        cnt = tl.where(last, end - start, 0)
        d = tl.arange(0, D)
        m = tl.full(cnt.shape, float("-inf"), tl.float32)
        den = tl.zeros(cnt.shape, tl.float32)
        acc = tl.zeros([cnt.shape[0], D], tl.float32)
        invalid = tl.zeros(cnt.shape, tl.int32)  # some state's lse is NaN or +inf
        for j in range(0, tl.max(cnt, 0)):
            ok = j < cnt
            p = tl.load(merge_partials + start + j, mask=ok, other=0).to(tl.int64)
            # .cg: read other programs' states from L2, never a stale L1 line.
            s = tl.load(PLSE + p * stride_ln + head, mask=ok, other=float("-inf"),
                        cache_modifier=".cg")
            o = tl.load(PO + p[:, None] * stride_pn + head[:, None] * stride_ph + d[None, :],
                        mask=head_cols(ok[:, None], d[None, :], HEAD_D, D), other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            invalid = tl.maximum(invalid, tl.where(s < float("inf"), 0, 1))
            m_new = tl.maximum(m, s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            a = tl.exp(m - m_safe)
            b = tl.exp(s - m_safe)
            acc = acc * a[:, None] + o * b[:, None]
            den = den * a + b
            m = m_new
        out, lse = _merged(acc, den, m, invalid)
        tl.store(O + qorig[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=head_cols(last[:, None], d[None, :], HEAD_D, D))
        tl.store(LSE + qorig * num_heads + head, lse, mask=last)
        tl.store(counts + cidx, 0, mask=last)


@triton.jit
def merge_kernel(
    PO, PLSE, O, LSE, indptr, indices,
    num_heads,
    stride_pn, stride_ph, stride_ln, stride_on, stride_oh,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
    HEADER: tl.constexpr, HEAD_D: tl.constexpr,
):
    n = tl.program_id(0)
    if HEADER:
        # Graph-safe launches: ``indptr`` and ``indices`` are the plan's first segment; the
        # CSR map's offsets come from the header before it (see tree_partial_kernel).
        indptr = indptr + tl.load(indptr - 8)
        indices = indices + tl.load(indices - 7)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    d = tl.arange(0, D)
    start = tl.load(indptr + n)
    end = tl.load(indptr + n + 1)
    # State indices are loaded one block ahead, so the state loads never wait on them.
    first = start + tl.arange(0, BLOCK_S)
    next_p = tl.load(indices + first, mask=first < end, other=0)
    if PDL:
        # The CSR map is the plan's; the partial states wait for the partial launch to end
        # (every program waits, with no return before).
        gdc_launch_dependents()
        gdc_wait()
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    invalid = tl.zeros([BLOCK_H], tl.int32)  # some state's lse is NaN or +inf
    # BLOCK_S partial states of BLOCK_H heads at a time (a state's heads are contiguous):
    # independent loads in flight, one rescale per block.
    for c in range(start, end, BLOCK_S):
        idx = c + tl.arange(0, BLOCK_S)
        p = next_p.to(tl.int64)
        ahead = idx + BLOCK_S
        next_p = tl.load(indices + ahead, mask=ahead < end, other=0)
        ok = (idx < end)[:, None] & h_ok[None, :]
        s = tl.load(PLSE + p[:, None] * stride_ln + heads[None, :], mask=ok,
                    other=float("-inf"))
        o = tl.load(PO + p[:, None, None] * stride_pn + heads[None, :, None] * stride_ph
                    + d[None, None, :], mask=head_cols(ok[:, :, None], d[None, None, :], HEAD_D, D),
                    other=0.0).to(tl.float32)
        invalid = tl.maximum(invalid, tl.max(tl.where(s < float("inf"), 0, 1), 0))
        m_new = tl.maximum(m, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_safe)
        b = tl.exp(s - m_safe[None, :])
        acc = acc * a[:, None] + tl.sum(tl.where(b[:, :, None] > 0, o * b[:, :, None], 0.0), 0)
        den = den * a + tl.sum(b, 0)
        m = m_new
    out, lse = _merged(acc, den, m, invalid)
    n64 = n.to(tl.int64)
    tl.store(O + n64 * stride_on + heads[:, None] * stride_oh + d[None, :],
             out.to(O.dtype.element_ty), mask=head_cols(h_ok[:, None], d[None, :], HEAD_D, D))
    tl.store(LSE + n64 * num_heads + heads, lse, mask=h_ok)
