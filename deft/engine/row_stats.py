"""Argmax and log-normaliser of logits rows in two Triton launches, for CUDA tensors.

A decode step's token pick reads every row of logits (128,256 entries for Llama 3) for its
argmax and for ``logsumexp`` (a token's log-probability is its logit minus it). PyTorch
reduces a row in one thread block per reduction: on an H200 an argmax of one bf16 row takes
about 28 µs and ``log_softmax`` of its float32 copy 30 µs, a percent of a greedy step. Here
each row is split over enough programs to fill the GPU, each keeping a running maximum,
the first index reaching it and a rescaled sum of exponentials; a second launch folds a
row's chunks. The argmax is the first maximal index, as ``torch.argmax`` returns. A row of
``-inf`` has index 0 and ``logsumexp`` ``-inf``; NaN logits are not supported.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["row_stats"]

_BLOCK = 1024  # entries a program reads per iteration


@triton.jit
def _chunk_kernel(X, M, S, I, V, stride, chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    index = tl.zeros([BLOCK], tl.int32)
    for off in range(0, CHUNK, BLOCK):
        cols = c * CHUNK + off + lanes
        x = tl.load(X + row * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new = tl.maximum(best, x)
        shift = tl.where(new == float("-inf"), 0.0, new)  # no -inf - -inf: both terms are 0
        total = total * tl.exp(best - shift) + tl.exp(x - shift)
        index = tl.where(x > best, cols, index)  # strictly greater: a lane keeps its first
        best = new
    m = tl.max(best, 0)
    s = tl.sum(total * tl.exp(best - tl.where(m == float("-inf"), 0.0, m)), 0)
    first = tl.min(tl.where(best == m, index, V), 0)
    out = row * chunks + c
    tl.store(M + out, m)
    tl.store(S + out, s)
    tl.store(I + out, first)


@triton.jit
def _fold_kernel(M, S, I, TOKENS, LOGP, LSE, V, chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < chunks
    m = tl.load(M + row * chunks + c, mask=ok, other=float("-inf"))
    s = tl.load(S + row * chunks + c, mask=ok, other=0.0)
    i = tl.load(I + row * chunks + c, mask=ok, other=V)
    top = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), 0)
    log_total = tl.log(total)
    tl.store(TOKENS + row, tl.min(tl.where(m == top, i, V), 0).to(tl.int64))
    tl.store(LOGP + row, -log_total)  # the argmax's log-probability: top - (top + log_total)
    tl.store(LSE + row, top + log_total)


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def row_stats(logits: torch.Tensor, programs: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(argmax, log_softmax at the argmax, logsumexp)`` of each row of ``logits [B, V]``:
    int64 ``[B]`` and float32 ``[B]`` twice, computed in float32 on the logits' device.
    ``programs``: how many programs to spread the rows over (default: two per SM)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits: expected [rows, vocab] with a vocab, got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    dev = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logp = torch.empty(rows, dtype=torch.float32, device=dev)
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows == 0:
        return tokens, logp, lse
    if programs is None:
        programs = _programs(dev) if dev.type == "cuda" else 4
    blocks = triton.cdiv(vocab, _BLOCK)
    per_row = max(1, min(blocks, triton.cdiv(programs, rows)))
    chunk = triton.cdiv(blocks, per_row) * _BLOCK
    chunks = triton.cdiv(vocab, chunk)
    m = torch.empty((2, rows, chunks), dtype=torch.float32, device=dev)
    first = torch.empty((rows, chunks), dtype=torch.int32, device=dev)
    _chunk_kernel[(rows, chunks)](logits, m[0], m[1], first, vocab, logits.stride(0), chunks,
                                  CHUNK=chunk, BLOCK=_BLOCK, num_warps=4)
    _fold_kernel[(rows,)](m[0], m[1], first, tokens, logp, lse, vocab, chunks,
                          BLOCK_C=triton.next_power_of_2(chunks), num_warps=4)
    return tokens, logp, lse
