"""A beam step's pick in three Triton launches, for CUDA tensors: the ``width`` best sums
``log_softmax(logits[b])[v] + scores[b]`` over every beam ``b`` and token ``v``.

A beam step's host waits for its pick. PyTorch's (a ``log_softmax``, an add, a ``topk`` over
``beams x vocab`` entries) took 176-301 µs from the call to the host's list on an H100 for
4-16 beams over Llama 3's 128,256 tokens, these launches 110-224 (CHANGELOG). Here:

1. a program per chunk of a row: the chunk's maximum and sum of exponentials (for the row's
   ``logsumexp``), and its ``width`` largest logits with their indices;
2. a program per row: the row's ``log(sum)`` from its chunks', and the row's ``width`` best
   of its chunks' candidates, each scored ``((x - max) - log(sum)) + score`` in float32 as
   PyTorch's ``log_softmax`` and add compute it (the sum in another order);
3. one program: the ``width`` best of the rows', as float64 values and flat indices
   ``b * vocab + v`` in one ``[2, width]`` tensor, read by the host in one copy.

A row's best sums are among its best logits, so each chunk passes on enough of them.
Candidates rank by a 64-bit key: the value's float32 bits, made order-preserving, above the
inverted flat index, so equal sums go to the lower index (unless two logits are so close
that their sums round equal while their logits do not; either may then be taken). NaN
logits are not supported. Picks too wide for the kernels (:func:`fits`: a row's chunks
passing on more than 4,096 candidates, or the beams' rows) are left to PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fits", "beam_top"]

_CHUNK = 2048  # entries of a row that a program of the first launch takes, at most
_MAX_KEYS = 4096  # keys that a program of the second or third launch ranks, at most
_MAX_FLAT = 2**31  # flat indices below it (the key's low half, inverted)


@triton.jit
def _key(value, index):
    """int64 key ordering by ``value`` (float32), then by lower ``index`` (int64)."""
    value = tl.where(value == 0, 0.0, value)  # -0.0 equals 0.0: one key
    bits = value.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: reversed
    return (bits.to(tl.int64) << 32) | (0xFFFFFFFF - index)


@triton.jit
def _value(key):
    """The float32 value of a :func:`_key`."""
    bits = (key >> 32).to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _index(key):
    """The index of a :func:`_key`."""
    return 0xFFFFFFFF - (key & 0xFFFFFFFF)


@triton.jit
def _pad():
    """A key below every entry's, ``-inf`` entries' included."""
    return _key(tl.full([], float("-inf"), tl.float32), tl.full([], 0xFFFFFFFF, tl.int64))


@triton.jit
def _chunk_kernel(X, KEYS, MAX, SUM, V, stride, chunks, CHUNK: tl.constexpr, W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    x = tl.load(X + row * stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    shift = tl.where(m == float("-inf"), 0.0, m)  # an all -inf chunk sums to 0
    out = row * chunks + c
    tl.store(MAX + out, m)
    tl.store(SUM + out, tl.sum(tl.exp(x - shift), 0))
    keys = tl.where(ok, _key(x, cols.to(tl.int64)), _pad())
    tl.store(KEYS + out * W + tl.arange(0, W), tl.topk(keys, W))


@triton.jit
def _row_kernel(KEYS, MAX, SUM, SCORES, BEST, V, chunks, N: tl.constexpr, BLOCK_C: tl.constexpr,
                W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    m = tl.load(MAX + row * chunks + c, mask=c < chunks, other=float("-inf"))
    top = tl.max(m, 0)
    s = tl.load(SUM + row * chunks + c, mask=c < chunks, other=0.0)
    log_sum = tl.log(tl.sum(s * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), 0))
    at = tl.arange(0, N)
    pad = _pad()
    keys = tl.load(KEYS + row * chunks * W + at, mask=at < chunks * W, other=pad)
    total = ((_value(keys) - top) - log_sum) + tl.load(SCORES + row)
    keys = tl.where(keys == pad, pad, _key(total, row * V + _index(keys)))
    tl.store(BEST + row * W + tl.arange(0, W), tl.topk(keys, W))


@triton.jit
def _final_kernel(BEST, OUT, rows, width, N: tl.constexpr, W: tl.constexpr):
    at = tl.arange(0, N)
    pad = _pad()
    keys = tl.topk(tl.load(BEST + at, mask=at < rows * W, other=pad), W)
    i = tl.arange(0, W)
    tl.store(OUT + i, _value(keys).to(tl.float64), mask=i < width)
    tl.store(OUT + width + i, _index(keys).to(tl.float64), mask=i < width)


def _shape(rows: int, vocab: int, width: int) -> tuple[int, int] | None:
    """``(chunk, W)`` of a pick, or ``None`` where the kernels do not fit it."""
    w = max(2, triton.next_power_of_2(width))  # Triton's topk takes no k of 1
    chunk = min(_CHUNK, triton.next_power_of_2(vocab))
    if (w > chunk or triton.cdiv(vocab, chunk) * w > _MAX_KEYS or rows * w > _MAX_KEYS
            or rows * vocab >= _MAX_FLAT or not 0 < width <= rows * vocab):
        return None
    return chunk, w


def fits(logits: torch.Tensor, width: int) -> bool:
    """Whether :func:`beam_top` takes ``logits`` ``[beams, vocab]`` (a CUDA tensor) and
    ``width`` (else the caller picks with PyTorch)."""
    return (logits.device.type == "cuda" and logits.dim() == 2
            and _shape(*logits.shape, width) is not None)


def beam_top(logits: torch.Tensor, scores: torch.Tensor, width: int) -> torch.Tensor:
    """``[2, width]`` float64: the ``width`` largest ``log_softmax(logits, -1) + scores[:,
    None]`` (float32 sums) over ``logits`` ``[beams, vocab]``, best first, and their flat
    indices ``beam * vocab + token``; ``scores`` ``[beams]`` float32 on the logits' device.
    No host synchronisation. Requires :func:`fits`."""
    rows, vocab = logits.shape
    shape = _shape(rows, vocab, width)
    if (shape is None or scores.shape != (rows,) or scores.dtype != torch.float32
            or scores.device != logits.device):
        raise ValueError(f"beam_top: logits {tuple(logits.shape)} with scores "
                         f"{tuple(scores.shape)} {scores.dtype} on {scores.device} and width "
                         f"{width} do not fit")
    chunk, w = shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    scores = scores.contiguous()
    dev = logits.device
    chunks = triton.cdiv(vocab, chunk)
    keys = torch.empty((rows, chunks, w), dtype=torch.int64, device=dev)
    stats = torch.empty((2, rows, chunks), dtype=torch.float32, device=dev)
    best = torch.empty((rows, w), dtype=torch.int64, device=dev)
    out = torch.empty((2, width), dtype=torch.float64, device=dev)
    _chunk_kernel[(rows, chunks)](logits, keys, stats[0], stats[1], vocab, logits.stride(0),
                                  chunks, CHUNK=chunk, W=w, num_warps=4)
    _row_kernel[(rows,)](keys, stats[0], stats[1], scores, best, vocab, chunks,
                         N=triton.next_power_of_2(chunks * w),
                         BLOCK_C=triton.next_power_of_2(chunks), W=w, num_warps=8)
    _final_kernel[(1,)](best, out, rows, width, N=triton.next_power_of_2(rows * w), W=w,
                        num_warps=8)
    return out
