"""The decode loop shared by the strategies: chunked prefill, shared prefixes, sampling.

A :class:`~deft.engine.requests.Branch` is a run of tokens growing from a cache node. Each
step, every live branch of every request feeds its pending tokens (part of a prompt, a
prefix, or the token it sampled last) in ONE ``engine.extend``; then all branches that wait
for a token sample it, one batched call per :attr:`~deft.engine.sampling.Sampler.batch_key`
(all greedy requests together, and on CUDA all sampled ones). Prompts are fed in chunks of at most
``engine.prefill_chunk`` tokens per step, alongside the other requests' decode tokens.
A branch whose feed is done forks its ``then`` branches, which continue from its last
token and share its K/V (a prompt's samples; the prompts that share a prefix). A
finished branch releases its K/V at once (``prune(release_unused_ancestors=True)``),
unless it keeps its last token for children (``keep_last``, tree search).

:class:`Batch` holds that loop's state so that requests can join and leave at any step
(the server's continuous batching), and executes it; its
:class:`~deft.engine.scheduling.BatchScheduler` decides which requests run and what fits.
:func:`decode` runs a batch to completion. A request with a ``strategy`` runs the
:class:`~deft.engine.requests.Search` it builds after its prompt (e.g.
:class:`~deft.engine.beams.BeamSearch`, :class:`~deft.engine.speculation.SpecSearch`):
each step feeds its tokens or draft trees in the same forward as the branches.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable, Collection, Iterator, Sequence

import torch

from ..cache import CacheFullError
from .core import TreeEngine
from .inflight import InFlight, draw
from .prompts import common_prefix
from .requests import Branch, Request, Search, SearchSpec
from .sampling import Sampler
from .scheduling import BatchScheduler, PrefixStore

__all__ = ["Batch", "Branch", "PrefixStore", "Request", "Search", "SearchSpec", "decode", "prefill",
           "release_on_error"]


@contextmanager
def release_on_error(engine: TreeEngine) -> Iterator[None]:
    """On an exception (e.g. ``CacheFullError``), prune every tree created inside the block."""
    cache = engine.cache
    before = {n for n in cache.live_nodes if cache.parent(n) < 0}
    try:
        yield
    except BaseException:
        for n in [n for n in cache.live_nodes if cache.parent(n) < 0 and n not in before]:
            cache.prune(n)
        raise


class Batch:
    """Requests and branches decoded stepwise: one :meth:`step` is one forward for all.

    Requests join at any step (:meth:`add`) and their prompts are prefilled in chunks next
    to the other requests' decode tokens; a request whose last branch ends (or that
    :meth:`cancel` stops) leaves and releases its nodes at once. Its ``scheduler``
    (:class:`~deft.engine.scheduling.BatchScheduler`, with ``max_running`` and ``prefixes``)
    admits requests and cuts each step to the free pages, deferring prompt chunks or
    preempting the youngest request (it restarts from its prompt later, with its sampler
    reseeded or its search built anew: a seeded or greedy request gives the same tokens);
    only what still does not fit with one request running raises
    :class:`~deft.CacheFullError`. Searches are admitted, preempted and cancelled the same
    way.

    With ``overlap`` (default: the engine's, on for CUDA) a step draws the sampled tokens on the
    device and feeds them to its forward there; the host reads them at the next step, while
    the GPU computes (:mod:`deft.engine.inflight`): stop tokens are seen one step late, the
    results are the same (a step that does not fit in the free pages waits for its tokens
    first, so that a drawn stop token's pages come back as they would without overlap).
    Steps that sample a ``keep_last`` branch wait for their tokens; searches read their
    logits on the host (a step with one waits for the last step).
    """

    def __init__(self, engine: TreeEngine, max_running: int | None = None,
                 prefixes: PrefixStore | None = None, overlap: bool | None = None) -> None:
        self.engine, self.prefixes = engine, prefixes
        cancel = weakref.WeakMethod(self.cancel)  # no cycle: a dropped batch frees at once
        self.scheduler = BatchScheduler(engine, max_running, prefixes,
                                        lambda req, reason: cancel()(req, reason))
        self.overlap = engine.overlap if overlap is None else bool(overlap)
        self.live: list[Branch] = []
        self.sampled = 0  # tokens that reached the host in the last step
        self.search_tokens = 0  # tokens the searches took in the last step
        self.prefill_tokens = 0  # prompt tokens computed, over all steps
        self._inflight: InFlight | None = None

    @property
    def max_running(self) -> int | None:
        return self.scheduler.max_running

    @property
    def waiting(self) -> Sequence[Request]:
        """The requests not admitted yet (or preempted), first in line first."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        """The admitted requests, oldest first."""
        return self.scheduler.running

    @property
    def stats(self) -> dict[str, int]:
        """``prefill_tokens`` computed and requests ``preempted``, over all steps."""
        return {"prefill_tokens": self.prefill_tokens, "preempted": self.scheduler.preempted}

    @property
    def pinned(self) -> Collection[int]:
        return self.prefixes.pinned if self.prefixes is not None else ()

    def add(self, request: Request) -> None:
        """Queue ``request``; it is admitted at a coming step."""
        self.scheduler.add(request)

    def add_branches(self, branches: Sequence[Branch]) -> None:
        """Run ``branches`` (already on their nodes) from the next step on."""
        self.live += branches

    def step(self) -> bool:
        """Sample every branch that waits for a token, admit requests, run ONE forward.

        Returns ``False`` only when nothing is left: no live branch and no waiting request.
        """
        engine = self.engine
        self.sampled = self._land()
        ready = [b for b in self.live if b.feed == [] and b.logits is not None
                 and b.sampler is not None and not b.done]
        if ready and self.overlap and not any(b.keep_last for b in ready):
            self._draw(ready)
        elif ready:
            _sample(engine, ready, self._release)
            self.sampled += len(ready)
        searches = self._advance_searches()
        self.live = [b for b in self.live if not b.done]
        for r in self.running:
            if r.search.done if r.search is not None else all(b.done for b in r.branches):
                r.status = "done"
        self._start(self.scheduler.admit(len(self.live)))
        feeding = [b for b in self.live if b.feed]
        if self._inflight is not None and self.scheduler.short_of_pages(feeding, searches):
            # A drawn stop token frees its branch's pages only once it lands: land the
            # drawn tokens now (this step waits for them) before preempting or failing.
            self.sampled += self._land()
            self.live = [b for b in self.live if not b.done]
            feeding = [b for b in self.live if b.feed]
        feeding, searches = self.scheduler.fit(feeding, searches)
        if not feeding and not searches:
            return self._inflight is not None
        chunk = engine.prefill_chunk
        items = [(b.node, b.feed[:chunk]) for b in feeding] + [it for s in searches for it in s.feed]
        modes = ["last" if len(b.feed) <= chunk and b.wants_logits() else "none" for b in feeding]
        modes += ["last"] * (len(items) - len(feeding))
        drawn = None if self._inflight is None else (
            self._inflight.tokens, [b.source for b in feeding] + [-1] * (len(items) - len(feeding)))
        rows, verified = engine.forward(items, [t for s in searches for t in s.trees], modes, drawn)
        for b, row, mode in zip(feeding, rows, modes):
            if not b.tokens and b.source < 0:  # (a drawn token lands next step)
                self.prefill_tokens += len(b.feed[:chunk])
            b.source = -1
            b.feed = b.feed[chunk:]
            if not b.feed:
                self._fed(b, row if mode == "last" else None)
        at, tree_at = len(feeding), 0
        for s in searches:
            n, m = len(s.feed), len(s.trees)
            s.take(rows[at:at + n], verified[tree_at:tree_at + m])
            at, tree_at = at + n, tree_at + m
        return True

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """Stop ``request`` now: its unfinished branches end with ``reason``, nodes released."""
        self.scheduler.leave(request)
        for b in request.branches:
            self.finish(b, reason)
        if request.root is not None and not request.root.done:
            self._release(request.root, reason)
        if request.search is not None and not request.search.done:
            request.search.release(self.pinned)
        for b in self.live:  # a prompt prefix shared with requests that are all gone
            if b.owner is None and b.then and not b.done and all(c.done for c in b.then):
                self._release(b, reason)
        request.status = "done"

    def close(self, reason: str = "cancelled") -> None:
        """End every request and branch now and release all their nodes (e.g. after an error)."""
        for r in list(self.running) + list(self.waiting):
            self.cancel(r, reason)
        for b in self.live:
            if not b.done:
                self._release(b, reason)
        self.live = []
        self._inflight = None

    def finish(self, branch: Branch, reason: str) -> None:
        """End ``branch`` now (e.g. a stop string matched) and release its node."""
        if not branch.done:
            branch.finish_reason = branch.finish_reason or reason
            self._release(branch, reason)

    # ------------------------------------------------------------ internals

    def _advance_searches(self) -> list[Search]:
        """Step every running search whose logits are in, then collect the searches with
        something to compute (what a failed step left is fed again): all step before any
        drafts, so searches that share a drafter draft in one call. A search that raises (its
        drafter, say; not :class:`~deft.CacheFullError`, the batch's own) ends its request
        alone, the exception in ``request.error``."""
        self.search_tokens, out = 0, []
        searching = [r for r in self.running if r.search is not None]
        for collect in (False, True):
            for r in [r for r in searching if r.status == "running"]:
                try:
                    if not collect and r.search.logits is not None:
                        self.search_tokens += r.search.step(self.pinned)
                    elif collect and (r.search.feed or r.search.trees):
                        out.append(r.search)
                except CacheFullError:
                    raise
                except Exception as exc:
                    r.error = exc
                    self.cancel(r, "error")
        return out

    def _draw(self, ready: list[Branch]) -> None:
        """Draw ``ready``'s tokens on the device; each feeds them from there unless it ends."""
        engine = self.engine
        last = [len(b.tokens) + 1 >= b.max_new_tokens  # can the token still be fed?
                or engine.position(b.node) >= engine.max_positions for b in ready]
        self._inflight = draw(ready, last)
        for i, (b, end) in enumerate(zip(self._inflight.branches, self._inflight.last)):
            b.logits = None
            if not end:
                b.feed, b.source = [0], i  # a placeholder id: the forward reads row i

    def _land(self) -> int:
        """Take in the tokens the last step drew (see :mod:`deft.engine.inflight`): append
        them, and end branches at a stop token or their last token; how many landed."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return 0
        landed = 0
        for b, t, lp, top, end in inflight.results():
            if b.done:  # cancelled, preempted or finished since: its token goes too
                continue
            landed += 1
            b.tokens.append(t)
            b.logprob += lp
            b.logprobs.append(lp)
            if b.top_logprobs:
                b.tops.append(top[:b.top_logprobs])
            if t in b.stop_ids or end:
                self._release(b, "stop" if t in b.stop_ids else "length")
            elif b.source >= 0:  # not fed yet (its step deferred it): feed the id from here
                b.feed, b.source = [t], -1
        return landed

    def _release(self, b: Branch, reason: str) -> None:
        b.done = True
        b.feed, b.logits, b.source = [], None, -1
        b.finish_reason = b.finish_reason or reason
        cache = self.engine.cache
        if b.node is None or not cache.is_live(b.node):
            return
        if self._keep_answer(b):
            cache.expect(b.node, 0)  # kept, it grows no more: no claim on the pages after it
        else:
            cache.prune(b.node, release_unused_ancestors=True, keep=self.pinned)

    def _keep_answer(self, b: Branch) -> bool:
        """Offer ``b``'s path to the prefix store if it is a ``pin_prompt`` request's one
        answer, ended by a stop or its length (see :class:`PrefixStore`)."""
        req = b.owner
        if (self.prefixes is None or req is None or not req.pin_prompt or req.n != 1
                or b.finish_reason not in ("stop", "length") or self.engine.cache.children(b.node)):
            return False
        return self.prefixes.insert((req.prompt + b.tokens)[:self.engine.position(b.node)], b.node)

    def _start(self, admitted: list[Request]) -> None:
        """Set up the branches (or search) of ``admitted`` requests: prompts forked from the
        prefix store where it holds a prefix, the others prefilled sharing common prefixes."""
        engine, plain = self.engine, []
        for req in admitted:
            leaf = _leaves(engine, req)
            hit = self.prefixes.match(req.prompt) if self.prefixes is not None else None
            if hit is None:
                plain.append((req.prompt, leaf))
            else:
                node, m = hit
                leaf.node, leaf.feed = engine.cache.fork(node, 1)[0], req.prompt[m:]
                _expect(engine, leaf)
                self.live.append(leaf)
        self.live += prompt_branches(engine, plain)

    def _fed(self, b: Branch, logits: torch.Tensor | None) -> None:
        """``b``'s feed is computed: fork its ``then`` branches, or end it."""
        cache = self.engine.cache
        b.logits = logits
        req = b.owner
        if req is not None and b is req.root and req.pin_prompt and self.prefixes is not None:
            self.prefixes.insert(req.prompt, b.node)
        if req is not None and b is req.root and req.search is not None:
            node = cache.fork(b.node, 1)[0] if req.pin_prompt else b.node  # the prompt stays put
            req.search.start(node, logits)
            b.done, b.logits = True, None
        elif b.then:
            kids = [c for c in b.then if not c.done]
            for c, node in zip(kids, cache.fork(b.node, len(kids)) if kids else []):
                c.node = node
                _expect(self.engine, c)
                if not c.feed:
                    c.logits = b.logits
            self.live += kids
            b.done, b.logits = True, None
            if not kids:
                cache.prune(b.node, release_unused_ancestors=True, keep=self.pinned)
        elif b.sampler is None or b.finish_reason is not None:  # fed what it had to
            b.done = True


def decode(engine: TreeEngine, branches: Sequence[Branch] = (), requests: Sequence[Request] = (),
           max_batch: int | None = None, progress: Callable[[int], None] | None = None,
           prefixes: PrefixStore | None = None) -> None:
    """Run ``branches`` and ``requests`` to completion in a :class:`Batch`, one forward per step.

    Requests are admitted in order while fewer than ``max_batch`` are running (all at
    once by default); an admitted prompt is prefilled in the same forwards as the other
    requests' decode tokens. ``progress(n)`` is called with the tokens sampled (and the
    searches' tokens) each step. A request's ``error`` is raised (every request then ends,
    its nodes released), as is an error of a step. ``prefixes``: the batch's prefix store
    (pinned prompts share their prefixes through it, as in ``deft serve``).
    """
    batch = Batch(engine, max_batch, prefixes)
    batch.add_branches(branches)
    for r in requests:
        batch.add(r)
    try:
        while True:
            more = batch.step()
            failed = next((r.error for r in requests if r.error is not None), None)
            if failed is not None:
                raise failed
            if progress is not None and batch.sampled + batch.search_tokens:
                progress(batch.sampled + batch.search_tokens)
            if not more:
                return
    except BaseException:
        batch.close("error")
        raise


def prompt_branches(engine: TreeEngine, prompts: list[tuple[list[int], Branch]]) -> list[Branch]:
    """The branches that prefill ``prompts``, each ``(ids, leaf)``, sharing common prefixes.

    ``leaf`` (``node`` unset) gets a node holding its prompt and the prompt's last
    logits. Prompts that agree on their first ``page_size`` tokens form a group whose
    longest common prefix is one root, fed once; each prompt then forks from it with the
    rest (a system prompt, a few-shot preamble: computed once, read once per step).
    Returns the root branches to run.
    """
    share = engine.config.page_size
    groups: dict[tuple[int, ...], list[tuple[list[int], Branch]]] = {}
    for i, (ids, leaf) in enumerate(prompts):
        key = tuple(ids[:share]) if len(ids) > share else (-1 - i,)
        groups.setdefault(key, []).append((ids, leaf))
    roots = []
    for members in groups.values():
        if len(members) == 1:
            ids, leaf = members[0]
            leaf.node, leaf.feed = engine.add_prompt([]), list(ids)
            _expect(engine, leaf)
            roots.append(leaf)
            continue
        first = members[0][0]
        common = min(len(ids) - 1 for ids, _ in members)  # each fork feeds >= 1 token
        for ids, _ in members:
            common = common_prefix(ids, first, common)
        for ids, leaf in members:
            leaf.feed = list(ids[common:])
        roots.append(Branch(engine.add_prompt([]), feed=list(first[:common]), then=[m[1] for m in members]))
        _expect(engine, roots[-1])
    return roots


def _expect(engine: TreeEngine, b: Branch) -> None:
    """Tell the cache how many tokens ``b``'s new node will hold: its feed, then the tokens
    it samples there (a branch that forks others once fed samples none), so that its pages
    are taken as one run (:meth:`~deft.cache.TreeKVCache.expect`)."""
    own = b.max_new_tokens if b.sampler is not None and not b.then else 0
    engine.cache.expect(b.node, len(b.feed) + own)


def prefill(engine: TreeEngine, prompts: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
    """Prefill ``prompts`` (shared prefixes once, in chunks); per prompt its node and last logits."""
    leaves = [Branch(None, finish_reason="prefill") for _ in prompts]
    with release_on_error(engine):
        decode(engine, prompt_branches(engine, list(zip(prompts, leaves))))
    return [(b.node, b.logits) for b in leaves]


def _leaves(engine: TreeEngine, req: Request) -> Branch:
    """The branch that prefills ``req``'s prompt; its ``n`` samples are ``req.branches``
    (a search, ``req.search``, built by its ``strategy``, starts from its logits instead)."""
    if req.strategy is not None:
        req.branches, req.search = [], req.strategy.build(engine, req)
        req.root = Branch(None, finish_reason="prefill", owner=req)
        return req.root
    p = req.params
    sampler, stop = Sampler(p, engine.device), p.stop_ids(engine.tokenizer)
    req.branches = [Branch(None, sampler, stop, p.max_new_tokens, owner=req,
                           top_logprobs=req.top_logprobs) for _ in range(req.n)]
    if req.n == 1 and not req.pin_prompt:
        req.root = req.branches[0]
    else:
        req.root = Branch(None, then=req.branches, owner=req)
    return req.root


def _sample(engine: TreeEngine, branches: list[Branch], release: Callable[[Branch, str], None]) -> None:
    """Pick each branch's next token (:func:`~deft.engine.inflight.draw`'s calls, waited
    for) and finish branches, in the batch's order.

    A finished branch (but one that keeps its last token) goes to ``release`` with its
    finish reason.
    """
    for b, t, lp, top, _ in draw(branches, [False] * len(branches)).results():
        b.logits = None
        b.tokens.append(t)
        b.logprob += lp
        b.logprobs.append(lp)
        if b.top_logprobs:
            b.tops.append(top[:b.top_logprobs])
        room = engine.position(b.node) < engine.max_positions  # can t still be fed?
        reason = ("stop" if t in b.stop_ids else
                  "length" if len(b.tokens) >= b.max_new_tokens or not room else None)
        if reason is None:
            b.feed = [t]
            continue
        b.finish_reason = reason
        if b.keep_last and room:
            b.feed = [t]
        elif b.keep_last:
            b.done = True
        else:
            release(b, reason)

