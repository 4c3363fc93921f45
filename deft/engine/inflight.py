"""Tokens sampled on the device and on their way to the host: decode steps that overlap.

An overlapped :class:`~deft.engine.decoding.Batch` step draws its branches' next tokens on
the device (:func:`draw`), feeds them to the next forward there (``TreeEngine.extend``'s
``device_tokens``) and copies them to the host without waiting. The host reads them at the
start of the following step (:meth:`InFlight.results`), while the GPU runs the forward it
has just queued, and plans that step meanwhile. So a stop token is seen one step late: its
branch has fed one token more, which is discarded with the branch. The rows are drawn in the
same calls as in steps that wait (:func:`~deft.engine.sampling.draw_rows`), so the results
equal theirs.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .sampling import Sampler, draw_rows

__all__ = ["InFlight", "draw"]


class Branch(Protocol):
    """What drawing needs of a :class:`deft.engine.requests.Branch`."""

    sampler: Sampler | None
    logits: torch.Tensor | None
    top_logprobs: int


class InFlight:
    """Tokens drawn for ``branches`` (row ``i`` for branch ``i``).

    ``tokens`` (int64 ``[B]``) stays on the device for the next forward; a copy of the
    tokens, their log-probabilities and the ``top`` most likely ``(token, log-probability)``
    pairs travels to the host. ``last[i]``: branch ``i`` ends after this token, whatever it is.
    ``at[i]``: branch ``i``'s place in the batch, the order :meth:`results` lists them in.
    """

    def __init__(self, branches: list[Branch], last: list[bool], tokens: torch.Tensor,
                 logps: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None,
                 at: Sequence[int] | None = None) -> None:
        self.branches, self.last, self.tokens = branches, last, tokens
        self._order = sorted(range(len(branches)), key=at.__getitem__) if at else None
        parts = [tokens, logps] + (list(top) if top is not None else [])
        self._event = None
        if tokens.device.type == "cuda":
            parts = [p.to("cpu", non_blocking=True) for p in parts]  # pinned: truly async
            self._event = torch.cuda.Event()
            self._event.record()
        self._host = parts

    def results(self) -> list[tuple[Branch, int, float, list[tuple[int, float]], bool]]:
        """Per branch, in the batch's order: the branch, its token, the token's
        log-probability, the top pairs and ``last``; waits for the copy (the draw, queued
        before the forward, is done first)."""
        if self._event is not None:
            self._event.synchronize()
        tokens, logps = self._host[0].tolist(), self._host[1].tolist()
        if len(self._host) > 2:
            values, indices = self._host[2].tolist(), self._host[3].tolist()
            tops = [list(zip(i, v)) for i, v in zip(indices, values)]
        else:
            tops = [[] for _ in tokens]
        rows = list(zip(self.branches, tokens, logps, tops, self.last))
        return rows if self._order is None else [rows[i] for i in self._order]


def draw(branches: Sequence[Branch], last: Sequence[bool]) -> InFlight:
    """Draw the next token of every branch from its ``logits`` on their device, one batched
    call per :attr:`~deft.engine.sampling.Sampler.batch_key` (as
    :func:`~deft.engine.decoding._sample` does, without a host copy)."""
    groups: dict[object, list[int]] = {}
    for i, b in enumerate(branches):
        groups.setdefault(b.sampler.batch_key, []).append(i)
    k = max(b.top_logprobs for b in branches)
    tokens, logps, values, indices = [], [], [], []
    for group in groups.values():
        logits = torch.stack([branches[i].logits for i in group])
        t, lp = draw_rows([branches[i].sampler for i in group], logits)
        tokens.append(t)
        logps.append(lp)
        if k:
            top = torch.topk(torch.log_softmax(logits.float(), -1), k, dim=-1)
            values.append(top.values)
            indices.append(top.indices)
    at = [i for group in groups.values() for i in group]  # the batch's row of each drawn row
    cat = (lambda xs: xs[0]) if len(groups) == 1 else torch.cat  # one call: no copy
    top = (cat(values), cat(indices)) if k else None
    return InFlight([branches[i] for i in at], [last[i] for i in at],
                    cat(tokens).to(torch.int64), cat(logps), top, at)
