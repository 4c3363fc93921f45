"""Token selection: greedy, temperature, top-k and top-p sampling, seeded per call.

The filters follow ``transformers``' order and semantics (temperature, then top-k, then
top-p keeping the smallest set of most likely tokens whose mass reaches ``top_p``).
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from .params import SamplingParams
from .pinned import to_device

__all__ = ["Sampler", "draw_rows", "filtered", "probabilities"]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``params`` samples from: ``[B, vocab]`` float32 from logits ``[B, vocab]``.

    Greedy parameters give a one-hot row at the argmax.
    """
    x = logits.float()
    if params.greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    rows = x.reshape(-1, x.shape[-1])
    return torch.softmax(filtered(rows, [params] * rows.shape[0]), dim=-1).reshape(x.shape)


def filtered(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Float32 logits ``[B, vocab]`` scaled and filtered as row ``i``'s sampling parameters
    ``params[i]`` (none greedy) ask: ``softmax`` of row ``i`` is the distribution it samples
    from. Each row's result depends on that row alone. Tokens tied with the k-th largest
    stay; at the top-p cut, of tokens tied in value the lower ids come first (a stable sort)."""
    vocab = x.shape[-1]
    k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p for p in params]
    # One upload: float64 holds every k, temperature and top-p exactly; the latter two are
    # rounded to float32 on the device, as a float32 op rounds a Python float.
    table = to_device(torch.tensor([[p.temperature for p in params], k, top_p],
                                   dtype=torch.float64, device="cpu").T.contiguous(), x.device)
    t, k_on, p_on = table[:, :1].float(), table[:, 1:2].long(), table[:, 2:].float()
    # Shifted by the row's maximum first: under a tiny temperature x / T overflows to inf
    # (and softmax to NaN), where (x - max) / T only underflows to -inf (the argmax's limit).
    x = (x - x.amax(-1, keepdim=True)) / t
    if not any(k) and min(top_p) == 1.0:
        return x
    if min(top_p) == 1.0:  # top-k alone: the k-th largest of each row, by a partial sort
        kth = torch.topk(x, max(k), dim=-1).values.gather(-1, (k_on - 1).clamp(min=0))
        return x.masked_fill((k_on > 0) & (x < kth), float("-inf"))
    ninf = float("-inf")
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    kth = sorted_x.gather(-1, (k_on - 1).clamp(min=0))
    sorted_x = sorted_x.masked_fill((k_on > 0) & (sorted_x < kth), ninf)  # ties with it stay
    p = torch.softmax(sorted_x, dim=-1)
    drop = (torch.cumsum(p, dim=-1) - p) >= p_on  # the mass before it already enough
    drop[:, 0] = False
    drop &= p_on < 1.0
    return torch.full_like(x, ninf).scatter_(-1, order, sorted_x.masked_fill(drop, ninf))


def _fused(device: torch.device) -> bool:
    """Whether picks on ``device`` take :func:`~deft.engine.token_pick.pick`'s kernels."""
    return device.type == "cuda"


class Sampler:
    """Picks the next token of many rows at once under one :class:`SamplingParams`.

    One ``torch.Generator`` per sampler: seeded by ``params.seed`` (so a call is
    reproducible), else from fresh entropy. On the CPU, ``torch.multinomial`` draws from
    :func:`probabilities` with it. On CUDA every pick runs :func:`~deft.engine.token_pick.pick`
    (the argmax, or Gumbel-max noise seeded from the sampler's seed, on the rows
    :func:`filtered` when top-k or top-p is on), each row chunked as if alone, so rows of
    several samplers can share a call (:func:`draw_rows`).
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
        self._key = ("greedy" if params.greedy else
                     "sampled" if _fused(self.generator.device) else id(self))

    @property
    def batch_key(self) -> object:
        """Rows whose samplers have equal keys are drawn in one call (:func:`draw_rows`):
        every greedy sampler's; on CUDA every sampled one's (its noise keyed by a seed of
        its own); on the CPU a sampled sampler's own (its generator draws them in order).
        Each row is picked as if alone, so one request's tokens and log-probabilities do not
        depend on the others'."""
        return self._key

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

            if not self.params.greedy:
                return _draw_sampled([self] * logits.shape[0], logits)
            tokens, logp, _ = pick(logits, alone=True)
            return tokens, logp
        if self.params.greedy:
            tokens = logits.argmax(-1)
        else:
            probs = probabilities(logits, self.params)
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logp


def draw_rows(samplers: Sequence[Sampler], logits: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """As :meth:`Sampler.draw`, row ``i`` of ``logits`` under ``samplers[i]``, samplers of one
    :attr:`~Sampler.batch_key`, in one call. Each sampler's rows draw what they would in a
    call of their own (its next seed, its rows' noise in their order)."""
    key = samplers[0].batch_key
    if any(s.batch_key != key for s in samplers):
        raise ValueError("draw_rows: samplers of one batch_key expected")
    return samplers[0].draw(logits) if key != "sampled" else _draw_sampled(samplers, logits)


def _draw_sampled(samplers: Sequence[Sampler], logits: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled rows on CUDA, one fused pick: plain temperature rows as they are (the kernel
    scales them), rows with top-k or top-p :func:`filtered` first and picked at temperature 1;
    log-probabilities under the unfiltered logits."""
    from .token_pick import pick

    drawn: dict[Sampler, list[int]] = {}  # per sampler: its seed, its rows so far
    rows: list[tuple[int, int, float]] = []  # per row: seed, noise row, temperature
    for s in samplers:
        if s not in drawn:
            drawn[s] = [s._seeds.getrandbits(31), 0]
        rows.append((*drawn[s], s.params.temperature))
        drawn[s][1] += 1
    seed, noise, temperature = zip(*rows)
    vocab = logits.shape[-1]
    hot = [i for i, s in enumerate(samplers)
           if s.params.top_p < 1.0 or 0 < s.params.top_k < vocab]
    if not hot:
        tokens, logp, _ = pick(logits, temperature, seed, alone=True, noise_rows=noise)
        return tokens, logp
    x = logits.to(torch.float32, copy=True)
    at = to_device(torch.tensor(hot, device="cpu"), logits.device)
    x[at] = filtered(x[at], [samplers[i].params for i in hot])
    hot_rows = set(hot)
    temperature = [1.0 if i in hot_rows else t for i, t in enumerate(temperature)]
    tokens = pick(x, temperature, seed, alone=True, noise_rows=noise)[0]
    lse = pick(logits, alone=True)[2]
    return tokens, logits.gather(-1, tokens[:, None]).squeeze(-1).float() - lse
