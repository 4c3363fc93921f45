"""Tree search (tree of thoughts): expand, score, keep the best, release the rest.

Each *thought* is a run of tokens in its own cache node, a child of the thought it
continues, so all thoughts share their ancestors' K/V. Per depth, the caller's
``expand(thought)`` lists continuations of every frontier thought; all of them are
generated together (one forward per step for the whole level); ``score(thought)`` ranks
the new thoughts, ``is_final(thought)`` sets solutions aside, the best ``beam_width``
form the next frontier, and every other thought's K/V is released at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ...checks import int_at_least
from ..core import TreeEngine
from ..decoding import Branch, decode, prefill, release_on_error
from ..prompts import Prompt, as_prompts
from ..params import SamplingParams
from ..sampling import Sampler

__all__ = ["Expansion", "Thought", "tree_search"]


@dataclass(frozen=True)
class Expansion:
    """One continuation: ``prefix`` token ids fed as given, then, if ``params`` is set,
    tokens generated with them (until a stop token or ``params.max_new_tokens``)."""

    prefix: Sequence[int] = ()
    params: SamplingParams | None = None

    def __post_init__(self) -> None:
        if not self.prefix and self.params is None:
            raise ValueError("Expansion: expected a prefix, params, or both; got neither")
        if self.params is not None and not isinstance(self.params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams or None, got {type(self.params).__name__}")


@dataclass(eq=False)
class Thought:
    """A node of the search: its tokens (prefix and generated), parent and score.

    ``node`` is the cache node holding its K/V (``None`` once released); ``logits``
    ``[vocab]`` follow its last token while it is on the frontier.
    """

    token_ids: list[int]
    text: str
    parent: Thought | None
    depth: int
    node: int | None = None
    logprob: float = 0.0
    score: float | None = None
    finish_reason: str | None = None
    logits: torch.Tensor | None = field(default=None, repr=False)

    def path_token_ids(self) -> list[int]:
        """Tokens of every thought from the first below the prompt down to this one."""
        parts, t = [], self
        while t is not None and t.parent is not None:
            parts.append(t.token_ids)
            t = t.parent
        return [x for part in reversed(parts) for x in part]


def tree_search(
    engine: TreeEngine,
    prompt: Prompt,
    expand: Callable[[Thought], Sequence[Expansion | Sequence[int]]],
    score: Callable[[Thought], float],
    beam_width: int = 2,
    max_depth: int = 3,
    is_final: Callable[[Thought], bool] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Thought]:
    """Breadth-first tree search from ``prompt``; the solutions and last frontier, best first.

    ``expand(t)`` returns continuations of thought ``t`` (``Expansion``s, or token-id
    lists meaning ``Expansion(prefix=ids)``); an empty list drops ``t``. The depth-0
    thought is the prompt. Thoughts for which ``is_final`` is true are kept as solutions
    and not expanded. Every thought that leaves the search releases its K/V at once;
    nothing stays in the cache when this returns.
    """
    beam_width = int_at_least(beam_width, "beam_width", 1)
    max_depth = int_at_least(max_depth, "max_depth", 1)
    (ids,) = as_prompts([prompt], engine)
    with release_on_error(engine):
        ((node, logits),) = prefill(engine, [ids])
        root = Thought(ids, engine.tokenizer.decode(ids), None, 0, node, logits=logits)
        frontier, solutions = [root], []
        samplers: dict[SamplingParams, Sampler] = {}
        for depth in range(1, max_depth + 1):
            children, branches = [], []  # (thought, expansion), Branch
            plans = [(t, [c if isinstance(c, Expansion) else Expansion(prefix=list(c)) for c in expand(t)])
                     for t in frontier]
            for t, conts in plans:
                if not conts or (t.logits is None and any(not c.prefix for c in conts)):
                    _release(engine, t)
                    continue
                for node, c in zip(engine.cache.fork(t.node, len(conts)), conts):
                    children.append((Thought([], "", t, depth, node), c))
                    branches.append(_branch(engine, node, c, t.logits, samplers))
                t.logits = None
            if not branches:
                break
            decode(engine, branches, progress=progress)
            for (child, c), b in zip(children, branches):
                child.token_ids = list(c.prefix) + b.tokens
                child.text = engine.tokenizer.decode(child.token_ids)
                child.logprob, child.logits = b.logprob, b.logits
                child.finish_reason = b.finish_reason if c.params is not None else "prefix"
                child.score = float(score(child))
            ranked = sorted((child for child, _ in children), key=lambda t: -t.score)
            frontier = []
            for t in ranked:
                if is_final is not None and is_final(t):
                    solutions.append(t)
                    _release(engine, t)
                elif len(frontier) < beam_width:
                    frontier.append(t)
                else:
                    _release(engine, t)
        for t in frontier:
            _release(engine, t)
        return sorted(solutions + frontier, key=lambda t: -(t.score if t.score is not None else float("-inf")))


def _branch(engine: TreeEngine, node: int, c: Expansion, parent_logits: torch.Tensor | None,
            samplers: dict[SamplingParams, Sampler]) -> Branch:
    """The decode branch of continuation ``c`` in ``node``; it keeps its last token's K/V."""
    if c.params is None:  # prefix only: computed, never sampled
        return Branch(node, feed=list(c.prefix), finish_reason="prefix")
    sampler = samplers.get(c.params)
    if sampler is None:
        sampler = samplers[c.params] = Sampler(c.params, engine.device)
    return Branch(node, sampler, c.params.stop_ids(engine.tokenizer), c.params.max_new_tokens,
                  feed=list(c.prefix), logits=None if c.prefix else parent_logits, keep_last=True)


def _release(engine: TreeEngine, t: Thought) -> None:
    """Prune ``t``'s node and every ancestor no other thought uses."""
    if t.node is not None:
        engine.cache.prune(t.node, release_unused_ancestors=True)
    t.node, t.logits = None, None
