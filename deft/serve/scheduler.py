"""The scheduler: one thread owns the engine and runs the batch step by step.

HTTP handlers :meth:`Scheduler.submit` and :meth:`Scheduler.cancel` jobs from the event
loop; the scheduler thread takes them in at the next step boundary. Every job joins the
running :class:`~deft.engine.decoding.Batch` (continuous batching; prompts prefilled in
chunks next to the others' decoding, forked from the prefix cache where it helps; beams
advance a step per forward; a speculative job verifies its draft tree in the same
forward, with a drafter of its own). After every step the new tokens of every sampling
or speculative job are posted to its queue as text deltas (a speculative step may bring
several); a beam-search job's choices are posted whole when its search ends.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from typing import Any

from ..cache import CacheFullError
from ..distributed.group import TensorParallelError
from ..engine import TreeEngine
from ..engine.decoding import Batch, Request
from ..engine.params import GenerationResult
from ..engine.beams import BeamParams
from ..engine.speculation import SpecParams
from .jobs import ChoiceText, Delta, End, Job, TokenLogprob
from .metrics import Metrics
from .prefix_cache import PrefixCache

__all__ = ["Scheduler", "pages_on_paths"]

_IDLE_WAIT_S = 0.5


class Scheduler:
    """Owns ``engine``: at most ``max_running`` jobs of the batch decode at once, and
    :meth:`submit` takes jobs while at most ``max_queue`` would wait beyond them.
    ``drafters`` maps a speculative drafter name to its :class:`~deft.engine.Drafter` factory."""

    def __init__(self, engine: TreeEngine, max_running: int, max_queue: int, metrics: Metrics,
                 prefix_cache: bool = True, drafters: dict[str, Any] | None = None) -> None:
        self.engine, self.max_running, self.max_queue, self.metrics = engine, max_running, max_queue, metrics
        self.prefixes = PrefixCache(engine.cache) if prefix_cache else None
        self.batch = Batch(engine, max_running, self.prefixes)
        self.drafters = drafters or {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple[str, Job | None]] = []
        self._live = 0  # submitted jobs not ended
        calibrate_kv(engine)
        self._closed = self._stopping = False
        self.fatal: Exception | None = None  # what stopped the thread for good, if anything
        self._pending: deque[Job] = deque()  # not yet in the batch
        self._active: list[Job] = []  # in the batch
        self._thread = threading.Thread(target=self._run, name="deft-scheduler", daemon=True)
        self._seen = {"prefill": 0, "preempted": 0, "lookups": 0, "hits": 0, "hit_tokens": 0}
        metrics.pages_total.set(engine.cache.num_pages)

    # ------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread.start()

    @property
    def closed(self) -> bool:
        """:meth:`close` was called: no job is taken any more."""
        return self._closed

    @property
    def idle(self) -> bool:
        """No submitted job is still to end."""
        with self._lock:
            return self._live == 0

    def submit(self, jobs: list[Job]) -> bool:
        """Queue ``jobs`` (one request's), all or none: ``False`` when closed, or when more
        than ``max_queue`` jobs would wait beyond the ``max_running`` that decode."""
        with self._lock:
            if self._closed or self._live + len(jobs) > self.max_running + self.max_queue:
                return False
            self._live += len(jobs)
            self._inbox += [("submit", job) for job in jobs]
        self._wake.set()
        return True

    def cancel(self, job: Job) -> None:
        """Stop ``job`` at the next step boundary and release its pages."""
        with self._lock:
            self._inbox.append(("cancel", job))
        self._wake.set()

    def close(self) -> None:
        """Take no more jobs; the submitted ones go on."""
        with self._lock:
            self._closed = True

    def abort(self) -> None:
        """End every submitted job at the next step boundary with a 503."""
        with self._lock:
            self._inbox.append(("abort", None))
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Take no more jobs, end the submitted ones with a 503, and stop the thread."""
        with self._lock:
            self._closed = self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            self._wake.clear()
            with self._lock:
                inbox, self._inbox, stopping = self._inbox, [], self._stopping
            for what, job in inbox:
                if what == "submit":
                    self._pending.append(job)
                elif what == "cancel":
                    self._drop(job, None)
                else:
                    self._drop_all(_SHUTDOWN)
            if stopping:
                self._drop_all(_SHUTDOWN)
                return
            self._feed_batch()
            busy = bool(self.batch.live or self.batch.waiting or self.batch.running)
            try:
                if busy:
                    self._step()
            except TensorParallelError as exc:  # a rank is lost: no step can run again
                self.fatal = exc
                with self._lock:
                    self._closed = True
                self._drop_all((503, f"the server lost a tensor-parallel rank: {exc}"))
                os.kill(os.getpid(), signal.SIGTERM)  # the HTTP server drains and stops
                return
            except Exception as exc:  # a bug must not stop the server: fail what was running
                self._drop_all(_internal(exc))
                self.batch.close("error")
                self.batch = Batch(self.engine, self.batch.max_running, self.prefixes)
            self._count()
            if not busy:
                self._wake.wait(_IDLE_WAIT_S)

    def _feed_batch(self) -> None:
        """Move the pending jobs into the batch, in order."""
        while self._pending:
            job = self._pending.popleft()
            beam = spec = None
            p, o = job.params, job.options
            try:
                if job.kind == "beam":
                    beam = BeamParams(o["num_beams"], p.max_new_tokens, o["length_penalty"],
                                      o["early_stopping"], job.n, p.stop_token_ids)
                    beam.check(self.engine)
                elif job.kind == "speculative":  # a drafter of its own: nothing shared
                    spec = SpecParams(self.drafters[o["drafter"]](), o["tree"])
                    spec.check(self.engine)
            except ValueError as exc:
                self._drop(job, (400, str(exc)))
                continue
            job.request = Request(job.prompt, max(job.n, job.best_of), job.params,
                                  top_logprobs=job.top_logprobs or 0,
                                  pin_prompt=self.prefixes is not None, strategy=beam or spec)
            self.metrics.prompt.inc(len(job.prompt))
            self.batch.add(job.request)
            self._active.append(job)

    def _step(self) -> None:
        try:
            self.batch.step()
        except CacheFullError as exc:  # the one request running does not fit: fail it only
            for job in [j for j in self._active if j.request.status == "running"]:
                self._drop(job, (400, str(exc)))
            return
        if self.batch.sampled:
            self.metrics.count_tokens(self.batch.sampled)
        now = time.monotonic()
        for job in list(self._active):
            if job.request.error is not None:  # its search raised: it fails alone
                self._drop(job, _internal(job.request.error))
            elif job.request.status != "waiting":
                if job.started_at is None:
                    job.started_at = now
                    self.metrics.queue_time.observe(now - job.arrival)
                self._publish(job, now)

    def _publish(self, job: Job, now: float) -> None:
        """Post ``job``'s new text; end it once all its choices have ended."""
        if job.kind == "beam":
            if job.request.status == "done":
                self._active.remove(job)
                self._post_whole(job, job.request.search.results(self.engine.tokenizer, {}))
            return
        spec, tok = job.kind == "speculative", self.engine.tokenizer
        # A speculative job's one choice is its search (its tokens, done, finish_reason).
        branches = [job.request.search] if spec else job.request.branches
        if not job.choices:
            job.choices = [ChoiceText(tok, job.stop) for _ in branches]
        new_tokens = 0
        for i, (b, text) in enumerate(zip(branches, job.choices)):
            if text.ended:
                continue
            start = text.seen
            delta, new, stopped = text.update(b.tokens, b.done)
            new_tokens += new
            if stopped and not spec:  # (a search ends with its job, below)
                self.batch.finish(b, "stop")
            if job.best_of > job.n or not (new or text.ended):
                continue
            logprobs = [] if job.top_logprobs is None else [
                TokenLogprob(t, lp, top) for t, lp, top in
                zip(b.tokens[start:], b.logprobs[start:], b.tops[start:] or [[]] * new)]
            reason = ("stop" if stopped else b.finish_reason) if text.ended else None
            job.post(Delta(job.base_index + i, delta, logprobs, reason))
        if new_tokens:
            if spec:  # a sampling job's tokens are counted as the batch samples them
                self.metrics.count_tokens(new_tokens)
            if job.last_token_at is None:
                self.metrics.ttft.observe(now - job.arrival)
            else:
                gap = (now - job.last_token_at) / max(1, new_tokens // max(1, len(branches)))
                self.metrics.itl.observe(gap)
            job.last_token_at = now
        if all(t.ended for t in job.choices) or job.request.status == "done":
            if job.best_of > job.n:
                self._post_best(job)
            self._active.remove(job)
            self.batch.cancel(job.request)  # no-op unless a branch is still running
            self._end(job, End(len(job.prompt), sum(len(b.tokens) for b in branches)))

    def _post_best(self, job: Job) -> None:
        """``best_of`` sampled: post the ``n`` most likely choices, whole."""
        tok = self.engine.tokenizer
        ranked = sorted(zip(job.request.branches, job.choices), key=lambda bc: -bc[0].logprob)
        for i, (b, _) in enumerate(ranked[:job.n]):
            text = ChoiceText(tok, job.stop)
            delta, _, stopped = text.update(b.tokens, True)
            logprobs = [] if job.top_logprobs is None else [
                TokenLogprob(t, lp, top) for t, lp, top in
                zip(b.tokens, b.logprobs, b.tops or [[]] * len(b.tokens))]
            job.post(Delta(job.base_index + i, delta, logprobs, "stop" if stopped else b.finish_reason))

    def _post_whole(self, job: Job, results: list[GenerationResult]) -> None:
        """Post each of ``results``' text at once, then end ``job``."""
        tok = self.engine.tokenizer
        for i, r in enumerate(results):
            text = ChoiceText(tok, job.stop)
            delta, _, stopped = text.update(r.token_ids, True)
            job.post(Delta(job.base_index + i, delta, [], "stop" if stopped else r.stats["finish_reason"]))
        self.metrics.count_tokens(sum(len(r.token_ids) for r in results))
        self.metrics.ttft.observe(time.monotonic() - job.arrival)
        self._end(job, End(len(job.prompt), sum(len(r.token_ids) for r in results)))

    def _drop(self, job: Job, error: tuple[int, str] | None) -> None:
        """End ``job`` without a result: cancelled (``error`` None) or failed."""
        if job.finished:
            return
        if job in self._pending:
            self._pending.remove(job)
        if job in self._active:
            self._active.remove(job)
            self.batch.cancel(job.request)
        self._end(job, End(error=error or (499, "cancelled")))

    def _drop_all(self, error: tuple[int, str]) -> None:
        for job in list(self._pending) + list(self._active):
            self._drop(job, error)

    def _end(self, job: Job, end: End) -> None:
        """Post ``job``'s last event, count its outcome, and let another job in."""
        job.finished = True
        outcome = "ok" if end.error is None else "cancelled" if end.error[0] == 499 else "error"
        self.metrics.requests.labels(outcome).inc()
        self.metrics.e2e.observe(time.monotonic() - job.arrival)
        with self._lock:
            self._live -= 1
        job.post(end)

    def _count(self) -> None:
        """Refresh the gauges and counters, and the number of queued jobs."""
        m, batch, cache = self.metrics, self.batch, self.engine.cache
        waiting = sum(1 for j in self._active if j.request.status == "waiting")
        m.waiting.set(len(self._pending) + waiting)
        m.running.set(len(self._active) - waiting)
        m.pages_used.set(cache.allocator.num_used)
        m.kv_usage.set(cache.allocator.num_used / cache.num_pages)
        m.pages_requests.set(pages_on_paths(batch, self.prefixes))
        now = {"prefill": batch.stats["prefill_tokens"], "preempted": batch.stats["preempted"]}
        if self.prefixes is not None:
            pc = self.prefixes
            now |= {"lookups": pc.lookups, "hits": pc.hits, "hit_tokens": pc.hit_tokens}
            m.hit_rate.set(pc.hits / pc.lookups if pc.lookups else 0.0)
            m.entries.set(len(pc))
        for key, counter in (("prefill", m.computed), ("preempted", m.preempted), ("lookups", m.lookups),
                             ("hits", m.hits), ("hit_tokens", m.hit_tokens)):
            if key in now and now[key] > self._seen[key]:
                counter.inc(now[key] - self._seen[key])
                self._seen[key] = now[key]


def pages_on_paths(batch: Batch, prefixes: PrefixCache | None) -> int:
    """Pages on the paths from a root to ``batch``'s running branches and searches (the
    ``deft_kv_pages_requests`` gauge): the pages in use less those only ``prefixes``' idle
    entries hold and those only the draft trees below the searches' nodes hold (verified,
    taken or pruned at the next step). Costs the draft trees' tokens, not the tokens held."""
    cache, drafts = batch.engine.cache, []
    below = [c for r in batch.running if r.search is not None for n in r.search.nodes
             for c in cache.children(n)]
    while below:
        node = below.pop()
        drafts += set((cache.slots(node) // cache.page_size).tolist())  # one user per page it touches
        below += cache.children(node)
    idle = prefixes.idle_pages() if prefixes is not None else 0
    return cache.allocator.num_used - idle - cache.allocator.num_parked_with(drafts)


_SHUTDOWN = (503, "the server is shutting down")
# The K/V scales of an FP8 cache come from this text's step, not from a request's.
CALIBRATION_TEXT = (
    "The committee met on a cold Tuesday morning to review the budget. After a long debate "
    "about roads, schools and the new library, they agreed to meet again in March, when the "
    "figures for the winter would be known. Questions from the public followed: 12 in all.")


def calibrate_kv(engine: TreeEngine) -> None:
    """Give an engine whose K/V format needs scales (FP8) none yet has them from
    :data:`CALIBRATION_TEXT`: calibrated by the first request, they would change every
    later request's values."""
    if not engine.pool.calibrated:
        engine.calibrate(engine.tokenizer.encode(CALIBRATION_TEXT))


def _internal(exc: Exception) -> tuple[int, str]:
    """The HTTP error of an unexpected exception: 500, naming it."""
    return 500, f"internal error: {type(exc).__name__}: {exc}"
