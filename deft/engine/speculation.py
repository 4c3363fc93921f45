"""Speculative decoding over the tree cache, one request at a time, a step at a time.

Each step the drafter grows a draft tree whose root is the request's newest token (its
K/V not cached yet); the :class:`~deft.engine.decoding.Batch` adds it under the request's
leaf (each draft token a 1-token node) and verifies it in the step's one forward, next to
every other request's tokens, each query seeing exactly its own path. Acceptance walks
the tree from the root (greedy: follow the child equal to the target's argmax; sampling:
tree rejection sampling, :func:`accept_sampled`); the accepted path is committed to the
leaf (:meth:`~deft.cache.TreeKVCache.commit_path`), every other draft is pruned, and the
step yields the accepted drafts plus one token drawn from the target at the last accepted
node. A :class:`SpecSearch` is one request's state;
:func:`~deft.engine.strategies.speculative.speculative_generate` is a batch of them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Sequence

import torch

from ..cache import CacheFullError
from ..model.tokenizer import Tokenizer
from .core import TreeEngine
from .draft_trees import DraftTree, Shape, TreeGrower, as_shape
from .drafters import DraftJob, Drafter
from .params import GenerationResult, SamplingParams
from .sampling import probabilities

if TYPE_CHECKING:
    from .requests import Request

__all__ = ["SpecParams", "SpecSearch", "accept_greedy", "accept_sampled"]


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance of ``tree`` under target ``logits [len(tree), vocab]``.

    Returns the accepted draft nodes (a path from the root, root excluded) and the next
    token: the argmax at the last accepted node. The tokens are exactly those greedy
    decoding would produce from the same logits.
    """
    target = logits.argmax(-1).tolist()
    path, node = [], 0
    while True:
        token = target[node]
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == token), None)
        if nxt is None:
            return path, token
        path.append(nxt)
        node = nxt


def accept_sampled(tree: DraftTree, probs: torch.Tensor,
                   generator: torch.Generator) -> tuple[list[int], int]:
    """Tree rejection sampling of ``tree`` under target probabilities ``probs [len(tree), vocab]``.

    At each node, starting at the root, the children are tried in order. Child ``x`` drawn
    from the draft distribution ``q`` is accepted with probability ``min(1, p(x) / q(x))``;
    on rejection ``p <- norm(max(p - q, 0))`` and ``q <- norm(q`` without ``x)`` (the next
    sibling was drawn without replacement). A deterministic child (``q`` a point mass on
    ``x``) is accepted with probability ``p(x)``, and on rejection ``x`` is removed from
    ``p``. After an acceptance the walk continues at the child; when every child is
    rejected (or at a leaf) the next token is drawn from the current ``p``. Each emitted
    token is thus distributed exactly as ``p`` given the tokens before it.

    Returns the accepted draft nodes and the next token.
    """
    path, node = [], 0
    while True:
        p = probs[node].double()
        q = tree.draft_probs.get(node)
        q = None if q is None else q.double()
        accepted = None
        for child in tree.children[node]:
            x = tree.tokens[child]
            qx = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if qx > 0 and u * qx < float(p[x]):  # probability min(1, p(x) / q(x))
                accepted = child
                break
            if q is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = (p - q).clamp_min(0.0)
                q = q.clone()
                q[x] = 0.0
                q = q / q.sum() if q.sum() > 0 else q
            total = residual.sum()
            if total > 0:  # else p == q up to rounding, and x was accepted almost surely
                p = residual / total
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(accepted)
        node = accepted


@dataclass(frozen=True, eq=False)
class SpecParams:
    """How speculative requests draft: ``drafter`` proposes trees of ``tree``'s shape (a
    :class:`~deft.engine.TreeShape`/:class:`~deft.engine.TopKShape`, Medusa choice paths or
    a choices file; the drafter's ``default_shape`` when ``None``).

    Requests that share one ``SpecParams`` share its drafter and draft in one drafter call
    per step (with the first one's sampling parameters and generator); give each request
    its own, with a drafter of its own, to keep it apart from the others. Each request
    accepts with a generator of its own, seeded by its ``SamplingParams.seed``. As a
    request's ``strategy`` (a :class:`~deft.engine.requests.SearchSpec`) it runs a
    :class:`SpecSearch`.
    """

    drafter: Drafter
    tree: Shape | Sequence[Sequence[int]] | str | os.PathLike[str] | None = None
    shape: Shape = field(init=False, repr=False)
    waiting: list[SpecSearch] = field(init=False, repr=False)  # to draft, on the first read of a ``trees``

    def __post_init__(self) -> None:
        if not isinstance(self.drafter, Drafter):
            raise TypeError(f"drafter: expected a deft Drafter, got {type(self.drafter).__name__}")
        object.__setattr__(self, "shape", as_shape(self.tree, self.drafter.default_shape))
        object.__setattr__(self, "waiting", [])

    @property
    def tree_tokens(self) -> int:
        """The most tokens one step's draft tree holds (its root included)."""
        return self.shape.num_drafts + 1

    def check(self, engine: TreeEngine) -> None:
        """``ValueError`` unless the drafter proposes tokens of ``engine``'s vocabulary."""
        vocab = getattr(self.drafter, "vocab_size", engine.vocab_size)
        if vocab != engine.vocab_size:
            raise ValueError(f"drafter: expected the target's vocabulary of {engine.vocab_size} "
                             f"tokens, got a draft model with {vocab}")

    def build(self, engine: TreeEngine, request: Request) -> SpecSearch:
        """``request``'s search from its prompt, sampling under its ``params``."""
        return SpecSearch(engine, self, request.prompt, request.params)

    def pages_per_step(self, page_size: int) -> int:
        """The fresh pages of one draft tree."""
        return -(-self.tree_tokens // page_size)


class SpecSearch:
    """One request's speculative decoding over ``engine``'s tree cache, a step at a time.

    :meth:`start` with the prompt's node and its last logits; then each :meth:`step`
    accepts from the logits of the tree verified last (at first: the prompt's), commits
    the accepted path, appends the new ``tokens`` and leaves ``trees``, the next draft
    tree ``(node, parents, token_ids)`` to compute, whose result goes to :meth:`take`,
    until ``done``. ``node`` holds the K/V of the prompt and ``tokens`` but the newest.
    ``feed`` (items to compute) is always empty: a batch's searches share one protocol.
    """

    def __init__(self, engine: TreeEngine, spec: SpecParams, prompt: list[int],
                 params: SamplingParams) -> None:
        self.engine, self.cache, self.spec, self.sampling = engine, engine.cache, spec, params
        self.stop = self.sampling.stop_ids(engine.tokenizer)
        self.prompt, self.tokens = list(prompt), []
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        self.node = -1
        self.tree: DraftTree | None = None  # verified by ``logits`` (None: the prompt's last token)
        self.ids: list[int] = []  # the tree's cache nodes
        self.logits: torch.Tensor | None = None  # [len(tree), vocab]
        self.feed: list[tuple[int, list[int]]] = []
        self._trees: list[tuple[int, list[int], list[int]]] = []
        self.logprob = 0.0
        self.accepted: list[int] = []  # draft tokens accepted per step
        self.drafted, self.draft_s = 0, 0.0
        self.finish_reason: str | None = None
        self.done = False

    @property
    def nodes(self) -> list[int]:
        """The request's leaf, once started and until done."""
        return [self.node] if self.node >= 0 and not self.done else []

    @property
    def trees(self) -> list[tuple[int, list[int], list[int]]]:
        """The draft tree to verify next (``[]`` or one), drafted on first read."""
        if self in self.spec.waiting:
            self._draft()
        return self._trees

    def start(self, node: int, logits: torch.Tensor) -> None:
        """Begin from the prompt in ``node`` and its last token's ``logits`` ``[vocab]``."""
        self.node, self.logits = node, logits[None]

    def step(self, keep: Collection[int] = ()) -> int:
        """Accept from ``logits`` and queue the next draft; returns the new tokens. Released
        nodes' ancestors in ``keep`` stay."""
        tree, p = self.tree or DraftTree([self.prompt[-1]]), self.sampling
        if p.greedy:
            path, bonus = accept_greedy(tree, self.logits)
        else:
            path, bonus = accept_sampled(tree, probabilities(self.logits, p).cpu(), self.generator)
        if self.tree is not None:
            self.cache.commit_path(self.node, [self.ids[0]] + [self.ids[c] for c in path])
        new = [tree.tokens[c] for c in path] + [bonus]
        rows = self.logits[[0, *path]].float()
        logp = torch.log_softmax(rows, -1).gather(-1, torch.tensor(new, device=rows.device)[:, None])
        self.accepted.append(len(path))
        self.drafted += len(tree) - 1
        taken = self._emit(new, logp.squeeze(-1).tolist())
        self.tree, self.ids, self.logits = None, [], None
        if self.finish_reason is None and len(self.prompt) + len(self.tokens) > self.engine.max_positions:
            self.finish_reason = "length"  # the newest token has no position left
        if self.finish_reason is None:
            self.spec.waiting.append(self)
        else:
            self.release(keep)
        return taken

    def take(self, rows: Sequence[torch.Tensor],
             verified: Sequence[tuple[list[int], torch.Tensor]]) -> None:
        """The verified tree: its cache nodes and logits ``[len(tree), vocab]`` (``rows``,
        of the empty ``feed``, is empty)."""
        ((self.ids, self.logits),) = verified
        self._trees = []

    def release(self, keep: Collection[int] = ()) -> None:
        """End the search now (a cancel, a preemption, or its end): prune its nodes and
        forget it in the drafter."""
        if self in self.spec.waiting:
            self.spec.waiting.remove(self)
        self.spec.drafter.release(id(self))
        if self.cache.is_live(self.node):
            self.cache.prune(self.node, release_unused_ancestors=True, keep=keep)
        self.tree, self.logits, self._trees, self.done = None, None, [], True

    def result(self, tokenizer: Tokenizer, stats: dict[str, Any]) -> GenerationResult:
        """The request's tokens, text and log-probability; ``stats`` are added to its own."""
        out, steps = self.tokens, len(self.accepted)
        own = {"finish_reason": self.finish_reason, "prompt_tokens": len(self.prompt), "steps": steps,
               "accepted": self.accepted, "drafted": self.drafted,
               "tokens_per_step": len(out) / steps if steps else float("nan")}
        return GenerationResult(out, tokenizer.decode(out, skip_special_tokens=True), self.logprob,
                                {**own, **stats})

    def _emit(self, tokens: list[int], logprobs: list[float]) -> int:
        """Append ``tokens`` up to a stop token or ``max_new_tokens``; how many."""
        for n, (tok, lp) in enumerate(zip(tokens, logprobs), 1):
            self.tokens.append(tok)
            self.logprob += lp
            if tok in self.stop:
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.sampling.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                return n
        return len(tokens)

    def _draft(self) -> None:
        """Grow the next tree of every search waiting on ``spec`` in one drafter call.

        A draft model whose own cache is full drafts nothing this step (the root alone
        is verified) and forgets the sequences, to start them over at the next step; a
        sequence past the draft model's context (shorter than the target's) is verified
        root alone from then on. A sequence with no room for a draft token (its last step,
        by ``max_new_tokens`` or the target's context, or the draft model's context reached)
        is not sent to the drafter, which forgets it: it never drafts again.
        """
        batch, self.spec.waiting[:] = list(self.spec.waiting), []
        drafter, jobs, drafting = self.spec.drafter, [], []
        limit = drafter.max_positions
        for s in batch:
            context = s.prompt + s.tokens
            room = min(s.sampling.max_new_tokens - len(s.tokens),
                       s.engine.max_positions - len(context) + 1)
            if limit is not None:
                room = min(room, limit - len(context) + 1)
            job = DraftJob(id(s), context, TreeGrower(s.spec.shape, context[-1], max(room - 1, 0)))
            jobs.append(job)
            if room > 1:
                drafting.append(job)
            else:
                drafter.release(job.key)
        t0 = time.perf_counter()
        try:
            if drafting:
                drafter.draft(drafting, batch[0].sampling, batch[0].generator)
        except CacheFullError:
            for job in drafting:
                drafter.release(job.key)
                job.grower = TreeGrower(self.spec.shape, job.tokens[-1], 0)
        except Exception:  # this search fails; the others draft again when they are read
            self.spec.waiting[:] = [s for s in batch if s is not self]
            raise
        seconds = (time.perf_counter() - t0) / max(len(drafting), 1)
        vocab = self.engine.vocab_size
        drafted = {job.key for job in drafting}
        for s, job in zip(batch, jobs):
            bad = next((t for t in job.grower.tree.tokens if not 0 <= t < vocab), None)
            if bad is None:
                s.draft_s += seconds if job.key in drafted else 0.0
                s.tree = job.grower.tree
                s._trees = [(s.node, s.tree.parents, s.tree.tokens)]
            elif s is self:  # as a raising drafter, for this search alone
                mine = ValueError(f"drafter: proposed token id {bad}, outside the target's "
                                  f"vocabulary [0, {vocab})")
            else:
                self.spec.waiting.append(s)  # drafts again when read (and fails then)
        if self.tree is None:
            raise mine
