"""Beam search over the tree cache, with ``transformers``' semantics.

The beams of a prompt are leaves of one tree: a beam continued by one candidate grows
in place, a beam continued by several is forked (its K/V shared, not copied), a beam
not continued is pruned at once with every ancestor no other beam uses. A
:class:`BeamSearch` is one prompt's search, a step at a time; a
:class:`~deft.engine.decoding.Batch` runs searches next to sampled requests, each step's
beam tokens in the same forward as everything else
(:func:`~deft.engine.strategies.beam.beam_search` is such a batch).

Scores follow ``transformers``' ``_beam_search`` (v5): each step the top ``max(2, 1 +
#stop ids) * k`` continuations of all beams by summed log-probability (float32; on CUDA
picked by :func:`~deft.engine.beam_pick.beam_top` where it fits, equal sums to the lower
index); the best ``k`` that do not stop continue; a candidate among the top ``k`` that ends
with a stop token (or reaches ``max_new_tokens``) becomes a finished hypothesis scored
``sum_logprobs / generated_len ** length_penalty``, the best ``k`` of which are kept.
The search ends at ``max_new_tokens``, when ``early_stopping=True`` and ``k``
hypotheses are finished, or when no running beam can beat the worst kept hypothesis
(``early_stopping=False``: judged at the current length; ``"never"``: at
``max_new_tokens`` if ``length_penalty > 0``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, Collection, Sequence

import numpy as np
import torch

from ..checks import int_at_least, real_number
from ..model.tokenizer import Tokenizer
from .core import TreeEngine
from .params import GenerationResult, SamplingParams
from .pinned import to_device

if TYPE_CHECKING:
    from .requests import Request

__all__ = ["BeamParams", "BeamSearch", "MAX_LENGTH_PENALTY"]

_F = np.float32
# |length_penalty| at most this: length ** 32 stays finite (float64) for any length a context
# can hold (< 2**24); 6 ** 1000 is an OverflowError.
MAX_LENGTH_PENALTY = 32


@dataclass(frozen=True)
class BeamParams:
    """How one prompt's beam search runs: ``num_beams`` beams, at most ``max_new_tokens``
    new tokens, the ``num_return_sequences`` best hypotheses returned (see the module
    docstring for ``length_penalty`` and ``early_stopping``); ``stop_token_ids`` ``None``
    means the tokenizer's end-of-sequence ids. As a request's ``strategy`` (a
    :class:`~deft.engine.requests.SearchSpec`) it runs a :class:`BeamSearch`."""

    num_beams: int
    max_new_tokens: int = 64
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    stop_token_ids: frozenset[int] | None = None

    def __post_init__(self) -> None:
        k = int_at_least(self.num_beams, "num_beams", 1)
        int_at_least(self.max_new_tokens, "max_new_tokens", 1)
        n_ret = int_at_least(self.num_return_sequences, "num_return_sequences", 1)
        if n_ret > k:
            raise ValueError(f"num_return_sequences: expected at most num_beams={k}, got {n_ret}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping: expected True, False or 'never', "
                             f"got {self.early_stopping!r}")
        object.__setattr__(self, "length_penalty", real_number(
            self.length_penalty, "length_penalty",
            f"a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]",
            lambda x: abs(x) <= MAX_LENGTH_PENALTY))
        stop = SamplingParams(stop_token_ids=self.stop_token_ids).stop_token_ids  # validated
        object.__setattr__(self, "stop_token_ids", stop)

    def stop_ids(self, tokenizer: Tokenizer) -> frozenset[int]:
        """``stop_token_ids``, or the tokenizer's EOS ids when ``None``."""
        return tokenizer.eos_token_ids if self.stop_token_ids is None else self.stop_token_ids

    def check(self, engine: TreeEngine) -> int:
        """The candidates a step keeps on ``engine``; ``ValueError`` when its vocabulary has
        fewer."""
        width = max(2, 1 + len(self.stop_ids(engine.tokenizer))) * self.num_beams
        if width > engine.vocab_size:
            raise ValueError(f"num_beams: {self.num_beams} beams need {width} candidates per step, "
                             f"more than the vocabulary of {engine.vocab_size}")
        return width

    def search(self, engine: TreeEngine, prompt_len: int) -> BeamSearch:
        """A new search for a prompt of ``prompt_len`` tokens."""
        return BeamSearch(engine, self, prompt_len)

    def build(self, engine: TreeEngine, request: Request) -> BeamSearch:
        """``request``'s search, from its prompt."""
        return self.search(engine, len(request.prompt))

    def pages_per_step(self, page_size: int) -> int:
        """One fresh page per beam."""
        return self.num_beams


@dataclass
class _Beam:
    node: int
    tokens: list[int]
    score: np.float32  # sum of log-probabilities, float32 as in transformers


def _top(logits: torch.Tensor, scores: torch.Tensor, width: int) -> torch.Tensor:
    """``[2, width]`` float64: the ``width`` best sums ``log_softmax(logits) + scores[:, None]``
    and their flat indices; by the fused kernels on CUDA where they fit, else by PyTorch."""
    if logits.device.type == "cuda":
        from .beam_pick import beam_top, fits  # Triton: installed wherever CUDA paths run

        if fits(logits, width):
            return beam_top(logits, scores, width)
    top = torch.topk((torch.log_softmax(logits.float(), dim=-1) + scores[:, None]).reshape(-1),
                     width)
    return torch.stack((top.values.double(), top.indices.double()))


class BeamSearch:
    """One prompt's beam search over ``engine``'s tree cache, a step at a time.

    :meth:`start` with the prompt's node and its last logits; then each :meth:`step`
    scores the running beams' logits, moves their K/V to the new beams and sets ``feed``,
    the ``(node, [token])`` items to compute, whose logits rows go to :meth:`take`, until
    ``done``. ``finished`` holds the kept hypotheses ``(score, tokens, sum_logprob)``,
    best first. ``trees`` (draft trees to compute) is always empty: a batch's searches
    share one protocol (:class:`~deft.engine.requests.Search`).
    """

    trees: Sequence[tuple[int, list[int], list[int]]] = ()

    def __init__(self, engine: TreeEngine, params: BeamParams, prompt_len: int) -> None:
        self.cache, self.params, self.prompt_len = engine.cache, params, prompt_len
        self.stop = params.stop_ids(engine.tokenizer)
        self.width = params.check(engine)
        self.max_new = min(params.max_new_tokens, engine.max_positions - prompt_len + 1)
        self.running: list[_Beam] = []
        self.logits: torch.Tensor | None = None  # [len(running), vocab] of the running beams
        self.feed: list[tuple[int, list[int]]] = []  # items to compute before the next step
        self.finished: list[tuple[np.float32, list[int], np.float32]] = []
        self.improvable = True
        self.done = False

    @property
    def nodes(self) -> list[int]:
        """The running beams' nodes (leaves of the prompt's tree)."""
        return [b.node for b in self.running]

    def start(self, node: int, logits: torch.Tensor) -> None:
        """Begin from the prompt in ``node`` and its last token's ``logits`` ``[vocab]``."""
        self.running, self.logits = [_Beam(node, [], _F(0))], logits[None]

    def step(self, keep: Collection[int] = ()) -> int:
        """Advance one step from ``logits`` and set ``feed``, the ``(node, [token])`` items to
        compute next (none once ``done``); returns their number. Released nodes' ancestors
        in ``keep`` stay."""
        self.feed = self._grow(self._advance(), keep)
        return len(self.feed)

    def take(self, rows: Sequence[torch.Tensor],
             verified: Sequence[tuple[list[int], torch.Tensor]] = ()) -> None:
        """The logits ``[vocab]`` of ``feed``'s items, in order: the feed is computed
        (``verified``, of the empty ``trees``, is empty)."""
        self.logits, self.feed = torch.stack(list(rows)), []

    def release(self, keep: Collection[int] = ()) -> None:
        """End the search now (a cancel) and prune the running beams."""
        self.cache.prune_many([b.node for b in self.running if self.cache.is_live(b.node)],
                              release_unused_ancestors=True, keep=keep)
        self.running, self.logits, self.feed, self.done = [], None, [], True

    def results(self, tokenizer: Tokenizer, stats: dict[str, Any]) -> list[GenerationResult]:
        """The ``num_return_sequences`` best hypotheses; ``stats`` are added to each's."""
        return [GenerationResult(toks, tokenizer.decode(toks, skip_special_tokens=True), float(score),
                                 {"sum_logprob": float(logp),
                                  "finish_reason": "stop" if toks and toks[-1] in self.stop else "length",
                                  "prompt_tokens": self.prompt_len, **stats})
                for score, toks, logp in self.finished[:self.params.num_return_sequences]]

    def _advance(self) -> list[_Beam]:
        """Score one step from ``logits``: new running beams, finished hypotheses.

        Returns the previous running beams (their nodes are the new beams' parents).
        """
        k, lp, early_stopping = self.params.num_beams, self.params.length_penalty, self.params.early_stopping
        logits = self.logits  # [beams, vocab]
        scores = to_device(torch.tensor([b.score for b in self.running], dtype=torch.float32,
                                        device="cpu"), logits.device)  # the host waits below
        width, vocab = min(self.width, logits.numel()), logits.shape[1]
        # One copy to the host (the step's one synchronisation): float32 scores and indices
        # below 2^53 are exact in float64.
        values, indices = _top(logits, scores, width).tolist()
        gen_len = len(self.running[0].tokens) + 1
        last = gen_len >= self.max_new
        cands = [(_F(v), int(i) // vocab, int(i) % vocab) for v, i in zip(values, indices)]
        hits = [last or tok in self.stop for _, _, tok in cands]

        full = len(self.finished) == k
        if self.improvable and not (full and early_stopping is True):
            denom = _F(gen_len ** lp)
            for (v, beam, tok), hit in zip(cands[:k], hits[:k]):
                if hit:
                    self.finished.append((_F(v / denom), self.running[beam].tokens + [tok], v))
            self.finished.sort(key=lambda h: -h[0])  # stable: earlier hypotheses win ties
            del self.finished[k:]

        parents = self.running
        self.running = list(islice((_Beam(parents[beam].node, parents[beam].tokens + [tok], v)
                                    for (v, beam, tok), hit in zip(cands, hits) if not hit), k))
        self.logits = None
        if self.running:
            best_len = self.max_new if early_stopping == "never" and lp > 0 else gen_len
            best = _F(self.running[0].score / _F(best_len ** lp))
            self.improvable = self.improvable and (
                len(self.finished) < k or best > min(h[0] for h in self.finished))
        full = len(self.finished) == k
        self.done = all(hits) or not self.improvable or (full and early_stopping is True)
        return parents

    def _grow(self, parents: list[_Beam], keep: Collection[int]) -> list[tuple[int, list[int]]]:
        """Move the K/V from ``parents`` to the new beams; the (node, [token]) items to compute."""
        cache = self.cache
        if self.done:
            cache.prune_many([b.node for b in parents], release_unused_ancestors=True, keep=keep)
            self.running = []
            return []
        by_node = Counter(b.node for b in self.running)
        cache.prune_many([b.node for b in parents if b.node not in by_node],
                         release_unused_ancestors=True, keep=keep)
        forks = {node: cache.fork(node, n) for node, n in by_node.items() if n > 1}
        items = []
        for b in self.running:
            if b.node in forks:
                b.node = forks[b.node].pop()
            items.append((b.node, b.tokens[-1:]))
        return items
