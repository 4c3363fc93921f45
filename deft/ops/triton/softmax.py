"""The partial kernel's online-softmax steps and its checks of non-finite values
(``@triton.jit`` helpers of :mod:`.kernels`, whose docstring states the isolation they keep):
scores and probabilities of a block, the accumulator's products, and the row tests
a work item's end and the masked blocks use."""

import triton
import triton.language as tl

__all__ = ["finite", "bad_rows", "bad_rows_by_sum", "no_neg_inf", "softmax_step", "scores",
           "accumulate", "fp16_queries"]


@triton.jit
def finite(x):
    """Elementwise: ``x`` is neither NaN nor ±inf (NaN fails every comparison)."""
    return tl.abs(x) < float("inf")


@triton.jit
def bad_rows(x):
    """``[BLOCK_N]`` int32: 1 where a row of ``x [BLOCK_N, D]`` holds a NaN or ±inf."""
    return tl.max(tl.where(finite(x), 0, 1), 1)


@triton.jit
def bad_rows_by_sum(x, SUMS: tl.constexpr):
    """:func:`bad_rows` of ``x``; ``SUMS``: read from each row's sum (an add per value
    instead of a test, a select and a max), which is not finite exactly when a value is not
    or when finite values overflow fp32; where some row's sum is not finite, the values are
    tested one by one."""
    if SUMS:
        bad = tl.where(finite(tl.sum(x, 1)), 0, 1)
        if tl.max(bad, 0) > 0:
            bad = bad_rows(x)
    else:
        bad = bad_rows(x)
    return bad


@triton.jit
def no_neg_inf(s):
    """Scores with -inf (a non-finite K row's, never a masked one's yet) made NaN."""
    return tl.where(s == float("-inf"), float("nan"), s)


@triton.jit
def softmax_step(s, m_i, l_i, acc, qk_scale, s_raw, RAW_INF: tl.constexpr):
    """Online-softmax step of one block of raw scores ``s`` (``-inf`` where not seen): the
    block's probabilities in base 2 and the updated running max, sum and accumulator. The
    scale folds into one FMA per score (the max commutes with a positive scale).
    ``RAW_INF``: a non-finite score of ``s_raw`` (the scores before any mask; in the
    unmasked blocks, every row sees every token) makes its probability NaN: the exponent's
    offset is ``s_raw * 0 - m``, which is ``-m`` exactly for a finite score and NaN for
    ±inf or NaN, one FMA where :func:`no_neg_inf` takes a test and a select."""
    # m_i starts finite (-1e30), so no -inf - -inf: masked scores give p = 0.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = probs(s, qk_scale, m_new, s_raw, RAW_INF)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, m_new, l_i, acc * alpha[:, None]


@triton.jit
def probs(s, qk_scale, m_new, s_raw, RAW_INF: tl.constexpr):
    """Base-2 probabilities of raw scores ``s`` under the running max ``m_new`` (``RAW_INF``:
    see :func:`softmax_step`). Its own function because the sm_90 builds with it inlined by
    hand compile differently (spills and loop lengths a few bytes and instructions either
    way) from the ones timed (``tools/kernel_registers.py``)."""
    if RAW_INF:
        p = tl.exp2(tl.fma(s, qk_scale, tl.fma(s_raw, 0.0, -m_new[:, None])))
    else:
        p = tl.exp2(tl.fma(s, qk_scale, -m_new[:, None]))
    return p


@triton.jit
def scores(q, k, IEEE: tl.constexpr):
    """``q @ k.T`` in fp32 (``IEEE``: fp32 operands multiplied exactly, not as tf32)."""
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        return tl.dot(q, tl.trans(k))


@triton.jit
def accumulate(p, v, acc, IEEE: tl.constexpr):
    """``acc + p @ v`` with ``p`` rounded to V's dtype (``IEEE`` as in :func:`scores`)."""
    if IEEE:
        return tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        return tl.dot(p.to(v.dtype), v, acc)


@triton.jit
def fp16_queries(q, qk_scale):
    """``q`` (bf16) as fp16 for fp16 dots, and the score scale to match. Exact while every
    finite element's magnitude is below 2^15 (bf16's 8-bit significands fit fp16's 11), but
    for elements under 2^-14, which round to fp16's subnormal steps of 2^-24; past 2^15 the
    program's q is scaled down by a power of two that the score scale undoes."""
    amax = tl.max(tl.max(tl.where(finite(q), tl.abs(q), 0.0), 1), 0).to(tl.float32)
    e = tl.where(amax > 32768.0, tl.ceil(tl.log2(amax)) - 15.0, 0.0)
    return (q * tl.exp2(-e)).to(tl.float16), qk_scale * tl.exp2(e)
