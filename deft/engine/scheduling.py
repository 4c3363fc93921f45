"""A batch's policy: which requests run, and what of a step fits in the cache's free pages.

The :class:`~deft.engine.decoding.Batch` executes (feeds, one forward, sampling, landing
tokens, releasing); its :class:`BatchScheduler` decides: admission (waiting to running, in
order), fitting a step to the free pages (eviction from the :class:`PrefixStore`, deferred
prompt chunks) and preemption.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Collection, Protocol

from .prompts import common_prefix
from .requests import Branch, Request, Search

if TYPE_CHECKING:
    from .core import TreeEngine

__all__ = ["BatchScheduler", "PrefixStore"]


class PrefixStore(Protocol):
    """Computed prompt nodes kept across requests (the server's prefix cache).

    The batch forks admitted prompts from ``match``, offers every computed prompt of a
    ``pin_prompt`` request to ``insert``, and the answer of such a request with one sampled
    branch when it ends by a stop or its length (its path: the prompt and the tokens
    computed; a chat's next turn starts with it); its scheduler asks ``evict`` for pages
    when a step does not fit, and the batch never releases a node of ``pinned`` when a
    branch ends.
    """

    pinned: set[int]

    def match(self, tokens: list[int]) -> tuple[int, int] | None:
        """A computed node whose path holds ``tokens[:m]`` (``m < len(tokens)``), and ``m``."""

    def insert(self, tokens: list[int], node: int) -> bool:
        """``node``'s path, just computed, holds ``tokens``; whether the store keeps it."""

    def cached(self, tokens: list[int]) -> tuple[int, int] | None:
        """The entry ``match`` would fork ``tokens`` from and how many of them it holds, or
        ``None``; nothing counted, split or marked."""

    def evict(self, pages: int, spare: Collection[int] = ()) -> None:
        """Release unreferenced cached nodes but the entries ``spare`` until ``pages`` more
        pages are free (or none is left)."""


class BatchScheduler:
    """Admission, fitting and preemption of a batch's requests.

    Requests are admitted in order while fewer than ``max_running`` run, once their prompt
    and first tokens fit next to the running branches: a prompt counts only the tokens that
    it does not share with a ``prefixes`` entry (forked, never evicted to admit it) or, as
    prompts admitted in the same step are prefilled, with the common prefix of those that
    start with its first page (fed once). When a step's tokens do not fit in
    the free pages, ``prefixes`` is asked to evict, then prompt chunks are deferred (never
    the oldest request's), then the youngest request is preempted: ``cancel`` releases it
    and it waits first in line, to restart from its prompt; ``prefixes`` is asked again
    after each cut (a preempted request's prompt entry is no longer pinned); nothing is
    admitted until a running request leaves. Search tokens are never deferred (a draft
    tree of ``t`` tokens may need ``ceil(t / page_size)`` fresh pages).
    """

    def __init__(self, engine: TreeEngine, max_running: int | None, prefixes: PrefixStore | None,
                 cancel: Callable[[Request, str], None]) -> None:
        self.engine, self.max_running, self.prefixes, self.cancel = engine, max_running, prefixes, cancel
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preempted = 0
        self._hold = False  # no admission after a preemption until a request leaves

    def add(self, request: Request) -> None:
        """Queue ``request`` last."""
        request.status = "waiting"
        self.waiting.append(request)

    def leave(self, request: Request) -> None:
        """Forget ``request`` (cancelled or preempted); admission resumes if it was running."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self._hold = False
            self.running = [r for r in self.running if r is not request]

    def admit(self, live: int) -> list[Request]:
        """Drop the requests that are ``"done"`` from ``running``, then move the waiting ones
        that fit next to ``live`` running branches to it, in order; returns those (now
        ``"running"``)."""
        left = len(self.running)
        self.running = [r for r in self.running if r.status == "running"]
        self._hold = self._hold and len(self.running) == left  # until a request leaves
        ps, admit, spare = self.engine.config.page_size, [], set()
        groups: dict[tuple[int, ...], list] = {}  # see _prompt_pages
        want = live + sum(_step_pages(r, ps) for r in self.running if r.search is not None)
        while not self._hold and self.waiting and (
                self.max_running is None or len(self.running) + len(admit) < self.max_running):
            req = self.waiting[0]
            need = self._prompt_pages(req, groups, spare) + _step_pages(req, ps)
            if (self.running or admit) and not self._room(want + need, spare):
                break
            want += need
            admit.append(self.waiting.popleft())
        for req in admit:
            req.status = "running"
        self.running += admit
        return admit

    def short_of_pages(self, feeding: list[Branch], searches: list[Search]) -> bool:
        """Whether ``feeding`` and ``searches`` need more pages than are free, once
        ``prefixes`` has evicted what it may."""
        want = self._need(feeding, searches)
        return want > self.engine.cache.num_free_pages and not self._room(want, ())

    def fit(self, feeding: list[Branch], searches: list[Search]) -> tuple[list[Branch], list[Search]]:
        """``feeding`` and ``searches`` cut to what fits the free pages (see the class docstring)."""
        order = {id(r): i for i, r in enumerate(self.running)}
        # Evict first, and again after each cut: a preempted request's prompt entry is
        # evictable once it no longer runs.
        while self.short_of_pages(feeding, searches):
            oldest = self.running[0] if self.running else None
            prompts = [b for b in feeding if b.owner is not None and b.owner is not oldest
                       and not b.tokens and b.source < 0]
            if prompts and (len(feeding) > 1 or searches):
                youngest = max(prompts, key=lambda b: order.get(id(b.owner), -1))
                feeding = [b for b in feeding if b is not youngest]
            elif len(self.running) > 1:
                self._preempt(self.running[-1])
                feeding = [b for b in feeding if not b.done]
                searches = [s for s in searches if not s.done]
            else:
                break
        return feeding, searches

    def _need(self, feeding: list[Branch], searches: list[Search]) -> int:
        """The pages a step of ``feeding`` and ``searches`` may take, as the engine counts them:
        ``ceil(n / page_size)`` per item and draft tree."""
        ps, chunk = self.engine.config.page_size, self.engine.prefill_chunk
        return (sum(-(-min(len(b.feed), chunk) // ps) for b in feeding)
                + sum(-(-len(f[-1]) // ps) for s in searches for f in (*s.feed, *s.trees)))

    def _room(self, want: int, spare: Collection[int]) -> bool:
        """Whether ``want`` pages are free, once ``prefixes`` has evicted what it may but the
        entries ``spare`` (those the requests being admitted fork from)."""
        free = self.engine.cache.num_free_pages
        if want > free and self.prefixes is not None:
            self.prefixes.evict(want - free, spare)
        return want <= self.engine.cache.num_free_pages

    def _prompt_pages(self, req: Request, groups: dict[tuple[int, ...], list],
                      spare: set[int]) -> int:
        """The fresh pages admitting ``req`` adds: its prompt's tokens beyond a ``prefixes``
        entry (added to ``spare``); else, as :func:`~deft.engine.decoding.prompt_branches`
        prefills the prompts admitted together, its share of its group's (the prompts of its
        first page, in ``groups``: ``[first prompt, common prefix, members, their tokens]``),
        whose common prefix is fed once and may shrink as it joins; plus a page per prompt a
        fork may start mid-page."""
        ps, prompt = self.engine.config.page_size, req.prompt
        hit = self.prefixes.cached(prompt) if self.prefixes is not None else None
        if hit is not None:
            spare.add(hit[0])
            return -(-(len(prompt) - hit[1]) // ps) + 1
        if len(prompt) <= ps:  # a group of its own
            return -(-len(prompt) // ps) + 1
        g = groups.get(key := tuple(prompt[:ps]))
        if g is None:
            groups[key] = [prompt, len(prompt) - 1, 1, len(prompt)]
            return -(-len(prompt) // ps) + 1
        before = _group_pages(g, ps)
        g[1] = common_prefix(prompt, g[0], min(g[1], len(prompt) - 1))
        g[2] += 1
        g[3] += len(prompt)
        return _group_pages(g, ps) - before

    def _preempt(self, req: Request) -> None:
        """Release ``req`` and queue it first, to restart from its prompt."""
        self.cancel(req, "preempted")
        req.branches, req.root, req.search = [], None, None
        req.restarts += 1
        self.preempted += 1
        self._hold = True
        self.waiting.appendleft(req)
        req.status = "waiting"


def _step_pages(r: Request, page_size: int) -> int:
    """The fresh pages one step of ``r`` may need: its strategy's, or one per branch."""
    return r.strategy.pages_per_step(page_size) if r.strategy is not None else r.n


def _group_pages(group: list, page_size: int) -> int:
    """The pages a group of prompts prefilled together takes (see
    :meth:`BatchScheduler._prompt_pages`): its common prefix once, then every member's rest,
    each on pages of its own."""
    _, common, members, tokens = group
    if members == 1:
        return -(-tokens // page_size) + 1
    return -(-common // page_size) + -(-(tokens - members * common) // page_size) + 2 * members
