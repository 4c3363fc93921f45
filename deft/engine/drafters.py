"""Drafters: who guesses the draft tokens that speculative decoding verifies.

A drafter grows each sequence's :class:`~deft.engine.draft_trees.DraftTree` through its
:class:`~deft.engine.draft_trees.TreeGrower`, level by level, offering ranked
:class:`~deft.engine.draft_trees.Candidates` for every frontier node.

* :class:`NgramDrafter` (prompt lookup): no model; the continuations of the longest recent
  n-gram match of each context in the sequence's own prompt and output.
* :class:`ModelDrafter`: a small model run through its own :class:`TreeEngine` and cache;
  one forward per tree level for all sequences, top-k (or sampled) children per node.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..checks import positive_int
from .core import TreeEngine
from .draft_trees import Candidates, DraftTree, Shape, TopKShape, TreeGrower
from .params import SamplingParams
from .sampling import probabilities

__all__ = ["DraftJob", "Drafter", "NgramDrafter", "ModelDrafter"]


@dataclass
class DraftJob:
    """One sequence to draft for: ``tokens`` is the whole sequence so far (prompt and
    output); its last token is the root of ``grower``'s tree."""

    key: int
    tokens: Sequence[int]
    grower: TreeGrower


class Drafter(ABC):
    """Grows draft trees. ``key`` identifies a sequence across steps until :meth:`release`."""

    #: The shape used when the caller gives none.
    default_shape: Shape = TopKShape()
    #: The longest sequence (context and draft) it can draft for; ``None``: no limit.
    max_positions: int | None = None

    @abstractmethod
    def draft(self, jobs: Sequence[DraftJob], params: SamplingParams,
              generator: torch.Generator) -> None:
        """Grow every job's tree until its grower is done."""

    def release(self, key: int) -> None:
        """Forget sequence ``key`` (it finished)."""


class _NgramIndex:
    """End positions of every n-gram (n in ``[1, max_n]``) of one growing sequence that has
    a next token."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self.ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n + 1)]

    def update(self, tokens: Sequence[int]) -> None:
        """Index ``tokens``, which extend the tokens indexed so far (else start over)."""
        old = len(self.tokens)
        if old > len(tokens) or list(tokens[:old]) != self.tokens:
            self.__init__(self.max_n)  # type: ignore[misc]
            old = 0
        self.tokens.extend(tokens[old:])
        toks = self.tokens
        for e in range(max(old - 1, 0), len(toks) - 1):  # n-grams ending at e, next token e + 1
            for n in range(1, min(self.max_n, e + 1) + 1):
                self.ends[n].setdefault(tuple(toks[e - n + 1 : e + 1]), []).append(e)


class NgramDrafter(Drafter):
    """Prompt-lookup drafting: no model, no extra forward.

    For a context (the sequence plus the draft path so far), the longest suffix of
    ``max_ngram`` down to ``min_ngram`` tokens that occurred earlier in the sequence is
    looked up; the tokens that followed its last ``max_matches`` occurrences are the
    candidates, most frequent first (then most recent). Shorter matches add further
    candidates after them. A candidate's score is its share of the matches times
    ``n / max_ngram`` for a match of ``n`` tokens (kept non-increasing), so the default
    shape drafts long chains only where long matches continue. Repeated along a path this
    copies long spans (edits, code, quotes), and several distinct continuations form a tree.
    """

    default_shape = TopKShape(k=2, depth=16, width=2, min_score=0.2)

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_matches: int = 64) -> None:
        max_ngram = positive_int(max_ngram, "max_ngram")
        min_ngram = positive_int(min_ngram, "min_ngram")
        max_matches = positive_int(max_matches, "max_matches")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram: expected at most max_ngram={max_ngram}, got {min_ngram}")
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches
        self._index: dict[int, _NgramIndex] = {}

    def __repr__(self) -> str:
        return (f"NgramDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram}, "
                f"max_matches={self.max_matches})")

    def draft(self, jobs: Sequence[DraftJob], params: SamplingParams,
              generator: torch.Generator) -> None:
        for job in jobs:
            index = self._index.setdefault(job.key, _NgramIndex(self.max_ngram))
            index.update(job.tokens)
            grower = job.grower
            while not grower.done:
                tree = grower.tree
                grower.grow([self.candidates(index, list(job.tokens) + tree.path(node), want)
                             for node, want in grower.frontier()])

    def release(self, key: int) -> None:
        self._index.pop(key, None)

    def candidates(self, index: _NgramIndex, context: list[int], want: int) -> Candidates:
        """Up to ``want`` ranked continuations of ``context`` found in ``index``."""
        tokens: list[int] = []
        scores: list[float] = []
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            ends = index.ends[n].get(tuple(context[-n:]))
            if not ends:
                continue
            recent = ends[-self.max_matches :]
            counts = Counter(index.tokens[e + 1] for e in recent)
            last = {index.tokens[e + 1]: i for i, e in enumerate(recent)}
            for tok, c in sorted(counts.items(), key=lambda kv: (-kv[1], -last[kv[0]])):
                if tok not in tokens:
                    score = c / len(recent) * n / self.max_ngram
                    tokens.append(tok)
                    scores.append(min(score, scores[-1]) if scores else score)
                    if len(tokens) == want:
                        return Candidates(tokens, scores)
        return Candidates(tokens, scores)


@dataclass
class _DraftState:
    """A sequence in the draft model's cache: node ``leaf`` holds ``tokens[:known]``;
    ``nodes`` maps last step's draft-tree nodes to cache nodes below ``leaf``."""

    leaf: int
    known: int
    tree: DraftTree | None = None
    nodes: dict[int, int] = field(default_factory=dict)


class ModelDrafter(Drafter):
    """Drafting with a small model that shares the target's vocabulary.

    The draft model runs through its own :class:`~deft.engine.core.TreeEngine` (its own
    cache). Each step, per sequence: the tokens accepted since the last step that the
    draft cache already holds (the accepted draft path) are committed, the rest are
    appended; then each tree level is one forward of the draft model over the frontier
    nodes of all sequences. A node's candidates are its ``k`` most likely tokens, or, with
    ``sample=True`` and a temperature above 0, tokens sampled without replacement from the
    draft distribution (at the request's temperature/top-k/top-p); acceptance then uses
    that distribution as ``q``.
    """

    default_shape = TopKShape(k=4, depth=5, width=4)

    def __init__(self, engine: TreeEngine, sample: bool = False) -> None:
        if not isinstance(engine, TreeEngine):
            raise TypeError(f"engine: expected a deft TreeEngine over the draft model, "
                            f"got {type(engine).__name__}")
        self.engine, self.sample = engine, bool(sample)
        self._state: dict[int, _DraftState] = {}

    def __repr__(self) -> str:
        return f"ModelDrafter(vocab_size={self.vocab_size}, sample={self.sample})"

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_positions(self) -> int:  # type: ignore[override]
        """The draft model's context: it may be shorter than the target's."""
        return self.engine.max_positions

    def draft(self, jobs: Sequence[DraftJob], params: SamplingParams,
              generator: torch.Generator) -> None:
        states = [self._catch_up(job) for job in jobs]
        # Level 0: append the pending tokens (ending with the root); their last logits
        # give the root's candidates.
        pending = [(st.leaf, list(job.tokens[st.known :])) for st, job in zip(states, jobs)]
        logits = self.engine.extend(pending, logits="last")
        for st, job in zip(states, jobs):
            st.known, st.tree, st.nodes = len(job.tokens), job.grower.tree, {0: st.leaf}
        front = [(i, 0) for i, job in enumerate(jobs) if not job.grower.done]
        logits = [logits[i] for i, _ in front]
        sample = self.sample and params.temperature > 0
        while front:
            wants = {(i, n): want for i in {i for i, _ in front}
                     for n, want in jobs[i].grower.frontier()}
            cands = dict(zip(front, self._candidates(torch.stack(logits), [wants[f] for f in front],
                                                     sample, params, generator)))
            expand = []  # (job, tree node) of the new level that will have children
            for i in sorted({i for i, _ in front}):
                grower = jobs[i].grower
                grower.grow([cands[(i, node)] for node, _ in grower.frontier()])
                expand += [(i, node) for node, _ in grower.frontier()]
            if not expand:
                break
            items = []
            for i, node in expand:
                st, tree = states[i], jobs[i].grower.tree
                child = self.engine.cache.fork(st.nodes[tree.parents[node]], 1)[0]
                st.nodes[node] = child
                items.append((child, [tree.tokens[node]]))
            logits = self.engine.extend(items, logits="last")
            front = expand

    def release(self, key: int) -> None:
        st = self._state.pop(key, None)
        if st is not None:
            self.engine.cache.prune(st.leaf)

    def _catch_up(self, job: DraftJob) -> _DraftState:
        """The job's draft-cache state, holding K/V of all but the last tokens it can reuse."""
        tokens, cache = job.tokens, self.engine.cache
        st = self._state.get(job.key)
        if st is None:  # the prompt is computed with the first level
            st = _DraftState(self.engine.add_prompt(tokens[:-1]), len(tokens) - 1)
            self._state[job.key] = st
            return st
        path, node = [], 0
        tree = st.tree
        while tree is not None and st.known + len(path) < len(tokens) - 1:
            want = tokens[st.known + len(path)]
            nxt = next((c for c in tree.children[node]
                        if c in st.nodes and tree.tokens[c] == want), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        cache.commit_path(st.leaf, [st.nodes[n] for n in path])
        st.known += len(path)
        st.tree, st.nodes = None, {}
        return st

    def _candidates(self, logits: torch.Tensor, wants: list[int], sample: bool,
                    params: SamplingParams, generator: torch.Generator) -> list[Candidates]:
        """``wants[r]`` guesses from each row of draft logits ``[R, vocab]``."""
        k = max(wants)
        if not sample:
            top = torch.topk(torch.softmax(logits.float(), -1), k)
            tokens, scores = top.indices.tolist(), top.values.tolist()
            return [Candidates(t[:n], s[:n]) for t, s, n in zip(tokens, scores, wants)]
        q = probabilities(logits, params).float().cpu()
        # Gumbel top-k: k draws without replacement per row, in draw order.
        u = torch.rand(q.shape, generator=generator).clamp_min(1e-20)
        drawn = torch.topk(torch.log(q) - torch.log(-torch.log(u)), k).indices.tolist()
        scores = torch.topk(q, k).values.tolist()  # independent of the draws
        support = (q > 0).sum(-1).tolist()
        return [Candidates(d[:min(n, c)], s[:min(n, c)], row)
                for d, s, n, c, row in zip(drawn, scores, wants, support, q)]
