"""Draft-tree shapes for speculative decoding, and the per-step draft trees grown from them.

A draft tree's node 0 is its **root**: the newest token of the sequence, whose K/V is not
in the cache yet (the last accepted token). Every other node is one draft token, a guess
for the token after its parent. Two kinds of shape say which guesses to make:

* :class:`TreeShape`, fixed: node ``i`` takes the ``ranks[i]``-th best candidate the drafter
  offers for its parent (the Medusa choice-list format, :meth:`TreeShape.from_choices`).
* :class:`TopKShape`, grown each step: each node offers its ``k`` best candidates and each
  level keeps the ``width`` best of them by path score.

:class:`TreeGrower` grows one :class:`DraftTree` level by level, so that a drafter can
compute the candidates of every frontier node of every sequence in one batch.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

from ..checks import int_at_least, int_in_range, is_int, positive_int, real_number
from ..recorded import load_medusa_choices

__all__ = ["TreeShape", "TopKShape", "Shape", "DraftTree", "Candidates", "TreeGrower", "as_shape"]


@dataclass(frozen=True)
class TreeShape:
    """A fixed draft-tree shape.

    Node 0 is the root; node ``i > 0`` is a child of ``parents[i] < i`` and takes the
    drafter's ``ranks[i]``-th candidate (0 = best) for its parent's context. Siblings are
    listed in increasing rank: acceptance tries them in this order.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parents, ranks = tuple(self.parents), tuple(self.ranks)
        if not parents or parents[0] != -1:
            raise ValueError(f"parents: expected -1 first (the root), got {list(parents[:1])}")
        if len(ranks) != len(parents):
            raise ValueError(f"ranks: expected {len(parents)} entries like parents, got {len(ranks)}")
        children: list[list[int]] = [[] for _ in parents]
        depths, checked_parents, checked_ranks = [0], [-1], [ranks[0]]
        for i in range(1, len(parents)):
            p = int_in_range(parents[i], f"parents[{i}]", 0, i - 1)
            r = int_at_least(ranks[i], f"ranks[{i}]", 0)
            if any(checked_ranks[c] >= r for c in children[p]):
                raise ValueError(f"ranks[{i}]: expected siblings in increasing rank, got {r} "
                                 f"after {[checked_ranks[c] for c in children[p]]}")
            children[p].append(i)
            depths.append(depths[p] + 1)
            checked_parents.append(p)
            checked_ranks.append(r)
        object.__setattr__(self, "parents", tuple(checked_parents))
        object.__setattr__(self, "ranks", tuple(checked_ranks))
        object.__setattr__(self, "children", tuple(map(tuple, children)))
        object.__setattr__(self, "depths", tuple(depths))

    @property
    def num_drafts(self) -> int:
        """Draft tokens (nodes other than the root)."""
        return len(self.parents) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> TreeShape:
        """The shape of Medusa choice paths: ``[r0, r1, ...]`` is the draft reached by
        taking candidate ``r0`` of the root, then candidate ``r1`` of that node, ...
        Every path's prefix must be a path too (or empty)."""
        def ints(p: object) -> bool:  # a list of integers (not text, not floats or bools)
            return isinstance(p, Sequence) and not isinstance(p, (str, bytes)) and all(map(is_int, p))

        if not (isinstance(choices, Sequence) and not isinstance(choices, (str, bytes))
                and all(map(ints, choices))):
            raise ValueError(f"choices: expected a list of lists of integers, got {choices!r:.200}")
        paths = sorted({tuple(int(r) for r in p) for p in choices}, key=lambda p: (len(p), p))
        index: dict[tuple[int, ...], int] = {(): 0}
        parents, ranks = [-1], [0]
        for path in paths:
            if not path or path[-1] < 0:
                raise ValueError(f"choices: expected non-empty paths of ranks >= 0, got {list(path)}")
            if path[:-1] not in index:
                raise ValueError(f"choices: path {list(path)} has no parent path {list(path[:-1])}")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
        return cls(tuple(parents), tuple(ranks))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TreeShape:
        """:meth:`from_choices` of a Medusa choices JSON file (``Tree_Structure`` or ``paths``)."""
        return cls.from_choices(load_medusa_choices(path))

    @classmethod
    def chain(cls, depth: int) -> TreeShape:
        """``depth`` drafts in a line, each the best candidate (prompt-lookup style)."""
        depth = positive_int(depth, "depth")
        return cls((-1, *range(depth)), (0,) * (depth + 1))

    @classmethod
    def full(cls, k: int, depth: int) -> TreeShape:
        """Every node has its ``k`` best candidates as children, ``depth`` levels deep."""
        k, depth = positive_int(k, "k"), positive_int(depth, "depth")
        parents, ranks, level = [-1], [0], [0]
        for _ in range(depth):
            nxt = []
            for p in level:
                for r in range(k):
                    nxt.append(len(parents))
                    parents.append(p)
                    ranks.append(r)
            level = nxt
        return cls(tuple(parents), tuple(ranks))


@dataclass(frozen=True)
class TopKShape:
    """A shape grown each step: every frontier node offers its ``k`` best candidates, and
    each level keeps the ``width`` best of all of them by path score (the product of the
    candidates' scores from the root), ``depth`` levels deep. Paths scoring below
    ``min_score`` are not drafted (wasted drafts cost compute)."""

    k: int = 2
    depth: int = 8
    width: int = 2
    min_score: float = 0.0

    def __post_init__(self) -> None:
        for name in ("k", "depth", "width"):
            positive_int(getattr(self, name), name)
        real_number(self.min_score, "min_score", "a number in [0, 1)", lambda m: 0 <= m < 1)

    @property
    def num_drafts(self) -> int:
        return self.depth * self.width


Shape = Union[TreeShape, TopKShape]


def as_shape(tree: Shape | Sequence[Sequence[int]] | str | os.PathLike[str] | None,
             default: Shape) -> Shape:
    """A shape from ``tree``: a shape, Medusa choice paths, a choices JSON file, or ``None``."""
    if tree is None:
        return default
    if isinstance(tree, (TreeShape, TopKShape)):
        return tree
    if isinstance(tree, (str, os.PathLike)):
        return TreeShape.from_file(tree)
    if isinstance(tree, Sequence):
        return TreeShape.from_choices(tree)
    raise TypeError(f"tree: expected a TreeShape, TopKShape, Medusa choice paths, a choices file "
                    f"or None, got {type(tree).__name__}")


@dataclass
class Candidates:
    """A drafter's ranked guesses for the token after one context.

    ``tokens[r]`` is the ``r``-th guess and ``scores[r]`` its score (non-increasing, in
    ``(0, 1]``, e.g. the draft probability). ``probs`` ``[vocab]`` is set when the tokens were
    *sampled* without replacement from that draft distribution (they are then in sampling
    order and ``scores`` must not depend on which tokens were drawn); ``None`` when they are
    a deterministic function of the context.
    """

    tokens: list[int]
    scores: list[float]
    probs: torch.Tensor | None = None


@dataclass
class DraftTree:
    """One sequence's draft tree for one verification step.

    ``tokens [m]``, ``parents [m]`` (``parents[0] == -1``: the root), ``depths [m]``,
    ``children[i]`` in the order acceptance tries them, and ``draft_probs[i]`` ``[vocab]`` for
    each node whose children were sampled from that distribution.
    """

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    scores: list[float] = field(default_factory=lambda: [1.0])
    children: list[list[int]] = field(default_factory=lambda: [[]])
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float) -> int:
        """Append a child of ``parent``; returns its index."""
        i = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(self.scores[parent] * score)
        self.children.append([])
        self.children[parent].append(i)
        return i

    def path(self, node: int) -> list[int]:
        """Draft tokens from the root (excluded) down to ``node`` (included)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]


class TreeGrower:
    """Grows one :class:`DraftTree` from ``shape``, one level per :meth:`grow` call.

    ``frontier()`` lists the nodes of the newest level that want candidates and how many;
    the drafter answers with one :class:`Candidates` per frontier node. Levels stop at
    ``max_depth`` (e.g. the tokens the sequence may still generate).
    """

    def __init__(self, shape: Shape, root_token: int, max_depth: int) -> None:
        self.shape = shape
        self.tree = DraftTree([int(root_token)])
        self.max_depth = min(max_depth, shape.depth)
        self._shape_node = [0]  # TreeShape: shape node of each tree node
        self._level = [0] if self.max_depth > 0 else []

    @property
    def done(self) -> bool:
        return not self.frontier()

    def frontier(self) -> list[tuple[int, int]]:
        """``(tree node, number of candidates wanted)`` for each node to expand now."""
        if isinstance(self.shape, TopKShape):
            return [(n, self.shape.k) for n in self._level]
        out = []
        for n in self._level:
            kids = self.shape.children[self._shape_node[n]]
            if kids:
                out.append((n, self.shape.ranks[kids[-1]] + 1))
        return out

    def grow(self, candidates: Sequence[Candidates]) -> list[int]:
        """Add the next level from ``candidates`` (one per :meth:`frontier` entry, in order);
        returns the new nodes."""
        front = self.frontier()
        if len(candidates) != len(front):
            raise ValueError(f"candidates: expected {len(front)} (one per frontier node), "
                             f"got {len(candidates)}")
        tree = self.tree
        for (node, _), cand in zip(front, candidates):
            if cand.probs is not None:
                tree.draft_probs[node] = cand.probs
        if isinstance(self.shape, TopKShape):
            new = self._grow_topk(front, candidates)
        else:
            new = []
            for (node, _), cand in zip(front, candidates):
                kids = self.shape.children[self._shape_node[node]]
                for pos, kid in enumerate(kids):
                    # Sampled guesses are exchangeable: a rank gap must not skip a draw.
                    r = pos if cand.probs is not None else self.shape.ranks[kid]
                    if r < len(cand.tokens):
                        new.append(tree.add(node, cand.tokens[r], cand.scores[r]))
                        self._shape_node.append(kid)
        self._level = new if new and tree.depths[new[0]] < self.max_depth else []
        return new

    def _grow_topk(self, front: list[tuple[int, int]], candidates: Sequence[Candidates]) -> list[int]:
        """Best-first over the level: a node's guess ``r + 1`` competes only once guess ``r``
        was taken, so every node keeps a prefix of its guesses (in the order tried)."""
        tree, heap, taken, floor = self.tree, [], [], self.shape.min_score

        def offer(j: int, r: int) -> None:
            score = tree.scores[front[j][0]] * candidates[j].scores[r]
            if score >= floor:
                heapq.heappush(heap, (-score, j, r))

        for j in range(len(front)):
            if candidates[j].tokens:
                offer(j, 0)
        while heap and len(taken) < self.shape.width:
            _, j, r = heapq.heappop(heap)
            taken.append((j, r))
            if r + 1 < len(candidates[j].tokens):
                offer(j, r + 1)
        return [tree.add(front[j][0], candidates[j].tokens[r], candidates[j].scores[r])
                for j, r in sorted(taken)]
