"""What a :class:`~deft.engine.decoding.Batch` decodes: branches, requests, and the contract
of a search strategy.

A :class:`Request` samples ``n`` :class:`Branch` es from its prompt, or runs the search its
``strategy`` (a :class:`SearchSpec`) builds. A strategy is one module: a frozen spec value
with :meth:`SearchSpec.build` and :meth:`SearchSpec.pages_per_step`, and the
:class:`Search` it builds; the batch asks the spec, and knows no strategy by name
(:class:`~deft.engine.beams.BeamParams`, :class:`~deft.engine.speculation.SpecParams`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Collection, Protocol, Sequence, runtime_checkable

import torch

from .params import SamplingParams
from .sampling import Sampler

if TYPE_CHECKING:
    from .core import TreeEngine

__all__ = ["Branch", "Request", "Search", "SearchSpec"]


@dataclass(eq=False)
class Branch:
    """A run of tokens in ``node`` (``None`` until its parent branch forks it).

    ``feed``: tokens to compute (a chunk per step); ``logits`` ``[vocab]``: the row after
    the last computed token. A branch with a ``sampler`` then samples a token at a time
    until a stop token or ``max_new_tokens``; one without finishes when its feed is done.
    ``then``: branches forked from ``node`` once the feed is done; one with an empty feed
    starts from this branch's logits. ``owner``: the :class:`Request` it serves, if any.
    Each sampled token's log-probability is in ``logprobs``; with ``top_logprobs`` k > 0,
    ``tops`` holds each step's k most likely ``(token, log-probability)`` pairs.
    """

    node: int | None
    sampler: Sampler | None = None
    stop_ids: frozenset[int] = frozenset()
    max_new_tokens: int = 0
    feed: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    keep_last: bool = False
    then: list[Branch] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    finish_reason: str | None = None
    done: bool = False
    owner: Request | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: int = 0
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    source: int = -1  # >= 0: ``feed`` is one token drawn on the device, this row of the draw

    def wants_logits(self) -> bool:
        """Whether the last token of the feed needs its logits."""
        return self.sampler is not None or any(not c.feed for c in self.then) or (
            self.finish_reason is not None and not self.then)


class Search(Protocol):
    """A request's search, stepped by the :class:`~deft.engine.decoding.Batch` after its prompt.

    ``start`` gets the prompt's node and last logits; then, while not ``done``: once
    ``logits`` are in, ``step`` scores them (returning how far it got: the tokens it took,
    or the beams it advanced) and sets what to compute: ``feed``, ``(node, tokens)`` items
    whose last logits it wants, and ``trees``, ``(node, parents, tokens)`` draft trees; the
    batch computes both in its forward and hands their results to ``take``. ``release``
    ends it now; ``nodes`` are the leaves it holds. Released nodes' ancestors in ``keep``
    (the prefix store's) stay.
    """

    done: bool
    logits: torch.Tensor | None
    feed: Sequence[tuple[int, list[int]]]
    trees: Sequence[tuple[int, list[int], list[int]]]
    nodes: list[int]

    def start(self, node: int, logits: torch.Tensor) -> None: ...
    def step(self, keep: Collection[int] = ()) -> int: ...
    def take(self, rows: Sequence[torch.Tensor], verified: Sequence[tuple[list[int], torch.Tensor]]) -> None: ...
    def release(self, keep: Collection[int] = ()) -> None: ...


@runtime_checkable
class SearchSpec(Protocol):
    """A search strategy as a value, held by a :class:`Request` (its ``strategy``).

    ``build`` makes the request's :class:`Search` when the batch admits it (again after a
    preemption); ``pages_per_step`` bounds the fresh cache pages one of its steps may need,
    for the batch's admission and fitting.
    """

    def build(self, engine: TreeEngine, request: Request) -> Search: ...
    def pages_per_step(self, page_size: int) -> int: ...


@dataclass(eq=False)
class Request:
    """A prompt decoded into ``n`` branches that share its K/V.

    ``pin_prompt``: prefill the prompt into a node of its own and offer it (and, with
    ``n == 1``, the answer) to the batch's prefix store. ``strategy``: run the search it
    builds instead (``n`` is then unused; a search may read ``params``). Set by the batch:
    ``root`` (the branch that prefills the prompt), ``branches`` (the ``n`` samples),
    ``search`` (the :class:`Search`), ``status`` (``"waiting"``, ``"running"``, ``"done"``),
    ``restarts`` (times it was preempted) and ``error`` (what its search raised: it ended
    alone, ``"error"``, its nodes released).
    """

    prompt: list[int]
    n: int
    params: SamplingParams
    top_logprobs: int = 0
    pin_prompt: bool = False
    strategy: SearchSpec | None = None
    branches: list[Branch] = field(default_factory=list)
    root: Branch | None = None
    search: Search | None = None
    status: str = "waiting"
    restarts: int = 0
    error: Exception | None = None

    def __post_init__(self) -> None:
        if self.strategy is not None and not isinstance(self.strategy, SearchSpec):
            raise TypeError(f"strategy: expected a SearchSpec (with build and pages_per_step) or None, "
                            f"got {type(self.strategy).__name__}")
