"""Token selection: greedy, temperature, top-k and top-p sampling, seeded per call.

The filters follow ``transformers``' order and semantics (temperature, then top-k, then
top-p keeping the smallest set of most likely tokens whose mass reaches ``top_p``).
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from .params import SamplingParams

__all__ = ["Sampler", "draw_rows", "probabilities"]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``params`` samples from: ``[B, vocab]`` float32 from logits ``[B, vocab]``.

    Greedy parameters give a one-hot row at the argmax.
    """
    x = logits.float()
    if params.greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    # Shifted by the row's maximum first: under a tiny temperature x / T overflows to inf
    # (and softmax to NaN), where (x - max) / T only underflows to -inf (the argmax's limit).
    x = (x - x.amax(-1, keepdim=True)) / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(p, dim=-1) - p) >= params.top_p  # mass before it already enough
        drop[..., 0] = False
        x = torch.full_like(x, float("-inf")).scatter_(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)


def _fused(device: torch.device) -> bool:
    """Whether picks on ``device`` take :func:`~deft.engine.token_pick.pick`'s kernels."""
    return device.type == "cuda"


class Sampler:
    """Picks the next token of many rows at once under one :class:`SamplingParams`.

    One ``torch.Generator`` per sampler: seeded by ``params.seed`` (so a call is
    reproducible), else from fresh entropy. On CUDA, greedy and plain temperature sampling
    (no top-k or top-p) pick with :func:`~deft.engine.token_pick.pick` (Gumbel-max noise
    seeded from the same seed), each row chunked as if alone; other filters with
    ``torch.multinomial``. Rows of such samplers can share a call (:func:`draw_rows`).
    """

    def __init__(self, params: SamplingParams, device: str | torch.device = "cpu") -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        # Seeds of the fused CUDA picks' noise, drawn on the host (no synchronisation).
        self._seeds = random.Random(self.generator.initial_seed())

    @property
    def batch_key(self) -> object:
        """Rows whose samplers have equal keys are drawn in one call (:func:`draw_rows`):
        every greedy sampler's; on CUDA every plain temperature sampler's (its noise keyed by
        a seed of its own); else the sampler's own (its generator draws them in order).
        Each row is picked as if alone, so one request's tokens and log-probabilities do not
        depend on the others'."""
        p = self.params
        if p.greedy:
            return "greedy"
        if _fused(self.generator.device) and p.top_p == 1.0 and p.top_k <= 0:
            return "temperature"
        return id(self)

    def __call__(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Tokens for logits ``[B, vocab]`` and their log-probabilities under the model.

        The log-probability is of the unfiltered distribution (``log_softmax(logits)``),
        whatever the temperature, so scores of greedy and sampled sequences compare.
        """
        tokens, logp = self.draw(logits)
        return tokens.tolist(), logp.tolist()

    def draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As a call, but int64 tokens ``[B]`` and float32 log-probabilities ``[B]`` stay on
        the logits' device (no host synchronisation)."""
        if _fused(logits.device):  # fused picks: no one-block reductions over the vocab
            from .token_pick import pick

            p = self.params
            if p.greedy:
                tokens, logp, _ = pick(logits, alone=True)
                return tokens, logp
            if p.top_p == 1.0 and not 0 < p.top_k < logits.shape[-1]:
                tokens, logp, _ = pick(logits, p.temperature, self._seeds.getrandbits(31),
                                       alone=True)
                return tokens, logp
            tokens = self._sample(logits)
            lse = pick(logits)[2]
            return tokens, logits.gather(-1, tokens[:, None]).squeeze(-1).float() - lse
        tokens = logits.argmax(-1) if self.params.greedy else self._sample(logits)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logp

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        probs = probabilities(logits, self.params)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)


def draw_rows(samplers: Sequence[Sampler], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As :meth:`Sampler.draw`, row ``i`` of ``logits`` under ``samplers[i]``, samplers of one
    :attr:`~Sampler.batch_key`, in one call. Each sampler's rows draw what they would in a
    call of their own (its next seed, its rows' noise in their order)."""
    first = samplers[0]
    if first.batch_key != "temperature" or all(s is first for s in samplers):
        return first.draw(logits)
    from .token_pick import pick

    seeds: dict[int, int] = {}
    taken: dict[int, int] = {}
    rows: list[tuple[int, int, float]] = []  # per row: seed, noise row, temperature
    for s in samplers:
        if id(s) not in seeds:
            seeds[id(s)] = s._seeds.getrandbits(31)
        rows.append((seeds[id(s)], taken.get(id(s), 0), s.params.temperature))
        taken[id(s)] = rows[-1][1] + 1
    seed, noise, temperature = zip(*rows)
    tokens, logp, _ = pick(logits, temperature, seed, alone=True, noise_rows=noise)
    return tokens, logp
