"""Token picks from logits rows in two Triton launches, for CUDA tensors: the argmax (greedy)
or a temperature sample, the pick's log-probability and the row's ``logsumexp``.

A decode step's pick reads every row of logits (128,256 entries for Llama 3). PyTorch
reduces a row in one thread block per reduction, which leaves most of the GPU idle for an
argmax, a ``log_softmax`` or a temperature sample of a few rows. Here each row is split over enough
programs to fill the GPU; each keeps, per lane, a running maximum of the pick's key and the
first index reaching it, and a rescaled sum of exponentials of the logits; a second launch
folds a row's chunks.

The key is the logit (greedy: the first maximal index, as ``torch.argmax`` returns), or, to
sample at temperature ``T``, ``logit / T + g`` with ``g`` standard Gumbel noise from
Triton's Philox generator keyed by ``seed`` and the entry's position: the argmax of that is
a draw from ``softmax(logits / T)`` (the Gumbel-max trick). For ``T <= 1`` the key is
``logit + T * g``, the same argmax scaled by ``T``: ``logit / T`` overflows float32 under a
tiny ``T`` (every positive logit then ties at inf), where ``T * g`` only vanishes, leaving
the argmax. The log-probability is the
pick's under the unscaled logits (``logit - logsumexp``). A row of ``-inf`` picks index 0
with ``logsumexp`` ``-inf``; NaN logits are not supported.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl

from .pinned import to_device

__all__ = ["pick"]

_BLOCK = 1024  # entries a program reads per iteration


@triton.jit(do_not_specialize=["seed"])  # a fresh seed per call: one compiled kernel
def _chunk_kernel(X, KEY, RAW, IDX, MAX, SUM, V, stride, chunks, seed, x_scale, g_scale, ROWS,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, SAMPLE: tl.constexpr,
                  PER_ROW: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    noise_row = row
    if PER_ROW:  # int32 [rows, 4]: seed, noise row, x_scale and g_scale's float32 bits
        seed = tl.load(ROWS + row * 4)
        noise_row = tl.load(ROWS + row * 4 + 1).to(tl.int64)
        x_scale = tl.load(ROWS + row * 4 + 2).to(tl.float32, bitcast=True)
        g_scale = tl.load(ROWS + row * 4 + 3).to(tl.float32, bitcast=True)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # the key's running maximum
    raw = tl.full([BLOCK], float("-inf"), tl.float32)  # the logit where it was reached
    index = tl.zeros([BLOCK], tl.int32)
    top = tl.full([BLOCK], float("-inf"), tl.float32)  # the logits' running maximum
    total = tl.zeros([BLOCK], tl.float32)  # sum of exp(logit - top)
    for off in range(0, CHUNK, BLOCK):
        cols = c * CHUNK + off + lanes
        x = tl.load(X + row * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if SAMPLE:
            u = tl.rand(seed, (noise_row * V + cols).to(tl.int32))  # the same for any chunking
            key = x * x_scale - tl.log(-tl.log(u)) * g_scale
            if PER_ROW:  # a greedy row among sampled ones (u = 0 would give inf * 0)
                key = tl.where(g_scale == 0, x, key)
        else:
            key = x
        better = key > best  # strictly greater: a lane keeps its first
        index = tl.where(better, cols, index)
        raw = tl.where(better, x, raw)
        best = tl.maximum(best, key)
        new = tl.maximum(top, x)
        shift = tl.where(new == float("-inf"), 0.0, new)  # no -inf - -inf: both terms are 0
        total = total * tl.exp(top - shift) + tl.exp(x - shift)
        top = new
    k = tl.max(best, 0)
    first = tl.min(tl.where(best == k, index, V), 0)
    m = tl.max(top, 0)
    out = row * chunks + c
    tl.store(KEY + out, k)
    # The lane that holds the pick (lanes that never saw a key above -inf also hold index 0).
    tl.store(RAW + out, tl.sum(tl.where((index == first) & (best == k), raw, 0.0), 0))
    tl.store(IDX + out, first)
    tl.store(MAX + out, m)
    tl.store(SUM + out, tl.sum(total * tl.exp(top - tl.where(m == float("-inf"), 0.0, m)), 0))


@triton.jit
def _fold_kernel(KEY, RAW, IDX, MAX, SUM, TOKENS, LOGP, LSE, V, chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < chunks
    at = row * chunks + c
    key = tl.load(KEY + at, mask=ok, other=float("-inf"))
    idx = tl.load(IDX + at, mask=ok, other=V)
    k = tl.max(key, 0)
    first = tl.min(tl.where(key == k, idx, V), 0)
    raw = tl.sum(tl.where((idx == first) & (key == k), tl.load(RAW + at, mask=ok, other=0.0),
                          0.0), 0)
    m = tl.load(MAX + at, mask=ok, other=float("-inf"))
    top = tl.max(m, 0)
    s = tl.load(SUM + at, mask=ok, other=0.0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), 0))
    tl.store(TOKENS + row, first.to(tl.int64))
    tl.store(LOGP + row, raw - lse)
    tl.store(LSE + row, lse)


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _scales(temperature: float) -> tuple[float, float]:
    """``(x_scale, g_scale)`` of a pick's key ``x * x_scale + g * g_scale`` (module doc)."""
    if not (temperature >= 0 and temperature != float("inf")):
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature}")
    return (1.0, temperature) if temperature <= 1 else (1.0 / temperature, 1.0)


def pick(logits: torch.Tensor, temperature: float | Sequence[float] = 0.0,
         seed: int | Sequence[int] = 0, programs: int | None = None, alone: bool = False,
         noise_rows: Sequence[int] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, logp, lse)`` for logits ``[B, V]``: int64 tokens ``[B]`` (the argmax at
    ``temperature`` 0, else a draw from ``softmax(logits / temperature)`` with noise keyed
    by ``seed``, a 31-bit int), their float32 log-probabilities under the logits and the
    rows' float32 ``logsumexp``; no host synchronisation. ``programs``: how many programs
    to spread the rows over (default: two per SM); ``alone``: that many for each row, so a
    row is chunked as in a call of its own and its results do not depend on the other rows
    (rows of several requests picked in one call).

    Per-row draws (several requests' samples in one call): ``temperature`` and ``seed`` a
    value per row, and ``noise_rows[i]`` the row whose noise row ``i`` takes under its seed
    (default: its own), so a request's rows draw as in a call of their own."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits: expected [rows, vocab] with a vocab, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    per_row = not isinstance(temperature, (int, float))
    if per_row:
        noise_rows = range(rows) if noise_rows is None else noise_rows
        if isinstance(seed, int) or not len(temperature) == len(seed) == len(noise_rows) == rows:
            raise ValueError(f"per-row draws: expected a temperature, a seed and a noise row "
                             f"for each of the {rows} rows")
        if not all(0 <= v < 2**31 for v in (*seed, *noise_rows)):
            raise ValueError("per-row draws: seeds and noise rows are ints in [0, 2**31)")
        scales = torch.tensor([_scales(t) for t in temperature], dtype=torch.float32,
                              device="cpu")
        table = torch.cat([torch.tensor([list(seed), list(noise_rows)], dtype=torch.int32,
                                        device="cpu").T, scales.view(torch.int32)], 1)
        sample, seed, x_scale, g_scale = True, 0, 1.0, 0.0
    elif noise_rows is not None:
        raise ValueError("noise_rows: only for per-row draws (a temperature per row)")
    else:
        x_scale, g_scale = _scales(temperature)
        sample = temperature > 0
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logp = torch.empty(rows, dtype=torch.float32, device=dev)
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows == 0:
        return tokens, logp, lse
    if programs is None:
        programs = _programs(dev) if dev.type == "cuda" else 4
    blocks = triton.cdiv(vocab, _BLOCK)
    spread = programs if alone else triton.cdiv(programs, rows)
    chunk = triton.cdiv(blocks, max(1, min(blocks, spread))) * _BLOCK
    chunks = triton.cdiv(vocab, chunk)
    parts = torch.empty((4, rows, chunks), dtype=torch.float32, device=dev)
    first = torch.empty((rows, chunks), dtype=torch.int32, device=dev)
    table = to_device(table, dev) if per_row else first  # unread without PER_ROW
    _chunk_kernel[(rows, chunks)](logits, parts[0], parts[1], first, parts[2], parts[3], vocab,
                                  logits.stride(0), chunks, seed, x_scale, g_scale, table,
                                  CHUNK=chunk, BLOCK=_BLOCK, SAMPLE=sample, PER_ROW=per_row,
                                  num_warps=4)
    _fold_kernel[(rows,)](parts[0], parts[1], first, parts[2], parts[3], tokens, logp, lse,
                          vocab, chunks, BLOCK_C=triton.next_power_of_2(chunks), num_warps=4)
    return tokens, logp, lse
