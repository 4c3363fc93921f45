"""The decode loop shared by the strategies: chunked prefill, shared prefixes, sampling.

A :class:`Branch` is a run of tokens growing from a cache node. Each step, every live
branch of every request feeds its pending tokens (part of a prompt, a prefix, or the
token it sampled last) in ONE ``engine.extend``; then all branches that wait for a token
sample it, one batched call per sampler. Prompts are fed in chunks of at most
``engine.prefill_chunk`` tokens per step, alongside the other requests' decode tokens.
A branch whose feed is done forks its ``then`` branches, which continue from its last
token and share its K/V (a prompt's samples; the prompts that share a prefix). A
finished branch releases its K/V at once (``prune(release_unused_ancestors=True)``),
unless it keeps its last token for children (``keep_last``, tree search).
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from ..checks import is_int
from ..layout import as_index_array
from .core import TreeEngine
from .params import GenerationResult, SamplingParams
from .sampling import Sampler

__all__ = ["Branch", "Request", "as_prompts", "decode", "prefill", "release_on_error", "run_requests"]

Prompt = str | Sequence[int]


@dataclass(eq=False)
class Branch:
    """A run of tokens in ``node`` (``None`` until its parent branch forks it).

    ``feed``: tokens to compute (a chunk per step); ``logits`` ``[vocab]``: the row after
    the last computed token. A branch with a ``sampler`` then samples a token at a time
    until a stop token or ``max_new_tokens``; one without finishes when its feed is done.
    ``then``: branches forked from ``node`` once the feed is done; one with an empty feed
    starts from this branch's logits.
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

    def wants_logits(self) -> bool:
        """Whether the last token of the feed needs its logits."""
        return self.sampler is not None or any(not c.feed for c in self.then) or (
            self.finish_reason is not None and not self.then)


@dataclass(eq=False)
class Request:
    """A prompt decoded into ``n`` branches that share its K/V."""

    prompt: list[int]
    n: int
    params: SamplingParams
    branches: list[Branch] = field(default_factory=list)


def _check_not_bytes(p: object, name: str) -> None:
    if isinstance(p, (bytes, bytearray)):
        raise TypeError(f"{name}: expected text or token ids, got {type(p).__name__} "
                        "(decode bytes to text first)")


def as_prompts(prompts: Prompt | Sequence[Prompt], engine: TreeEngine) -> list[list[int]]:
    """A batch of token-id prompts from one prompt or many (text is encoded).

    Token ids may be a list or a 1-D numpy/torch integer array (a 2-D array is a batch).
    """
    _check_not_bytes(prompts, "prompts")
    arrays = (np.ndarray, torch.Tensor)
    if isinstance(prompts, arrays):
        prompts = list(prompts) if prompts.ndim == 2 else [prompts]
    elif isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and all(is_int(t) for t in prompts)
    ):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts: expected a prompt or a non-empty list of prompts, got {prompts!r}")
    out = []
    for i, p in enumerate(prompts):
        _check_not_bytes(p, f"prompts[{i}]")
        if isinstance(p, arrays):
            p = as_index_array(p, f"prompts[{i}]").tolist()
        ids = engine.tokenizer.encode(p) if isinstance(p, str) else p
        if not isinstance(ids, Sequence) or not ids or not all(is_int(t) for t in ids):
            raise ValueError(f"prompts[{i}]: expected text or a non-empty list of token ids, got {p!r}")
        if len(ids) > engine.max_positions:
            raise ValueError(f"prompts[{i}]: the prompt has {len(ids)} tokens, more than the "
                             f"model's context of {engine.max_positions}")
        out.append([int(t) for t in ids])
    return out


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


def decode(
    engine: TreeEngine,
    branches: Sequence[Branch] = (),
    requests: Sequence[Request] = (),
    max_batch: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Run ``branches`` and ``requests`` to completion, one forward per step.

    Requests are admitted in order while fewer than ``max_batch`` are running (all at
    once by default); an admitted prompt is prefilled in the same forwards as the other
    requests' decode tokens. ``progress(n)`` is called with the tokens sampled each step.
    """
    waiting, live, running = deque(requests), list(branches), []
    chunk = engine.prefill_chunk
    while True:
        ready = [b for b in live if b.feed == [] and b.logits is not None and b.sampler is not None
                 and not b.done]
        if ready:
            _sample(engine, ready)
            if progress is not None:
                progress(len(ready))
        live = [b for b in live if not b.done]
        running = [r for r in running if any(not b.done for b in r.branches)]
        admit = []
        while waiting and (max_batch is None or len(running) + len(admit) < max_batch):
            admit.append(waiting.popleft())
        live += prompt_branches(engine, [(r.prompt, _leaves(engine, r)) for r in admit])
        running += admit
        feeding = [b for b in live if b.feed]
        if not feeding:
            return
        modes = ["last" if len(b.feed) <= chunk and b.wants_logits() else "none" for b in feeding]
        rows = engine.extend([(b.node, b.feed[:chunk]) for b in feeding], logits=modes)
        for b, row, mode in zip(feeding, rows, modes):
            b.feed = b.feed[chunk:]
            if b.feed:
                continue
            b.logits = row if mode == "last" else None
            if b.then:
                for c, node in zip(b.then, engine.cache.fork(b.node, len(b.then))):
                    c.node = node
                    if not c.feed:
                        c.logits = b.logits
                live += b.then
                b.done, b.logits = True, None
            elif b.sampler is None or b.finish_reason is not None:  # fed what it had to
                b.done = True


def prompt_branches(engine: TreeEngine, prompts: list[tuple[list[int], Branch]]) -> list[Branch]:
    """The branches that prefill ``prompts``, each ``(ids, leaf)``, sharing common prefixes.

    ``leaf`` (``node`` unset) gets a node holding its prompt and the prompt's last
    logits. Prompts that agree on their first ``page_size`` tokens form a group whose
    longest common prefix is one root, fed once; each prompt then forks from it with the
    rest (a system prompt, a few-shot preamble: computed once, read once per step).
    Returns the root branches to run.
    """
    share = engine.pool.page_size
    groups: dict[tuple[int, ...], list[tuple[list[int], Branch]]] = {}
    for i, (ids, leaf) in enumerate(prompts):
        key = tuple(ids[:share]) if len(ids) > share else (-1 - i,)
        groups.setdefault(key, []).append((ids, leaf))
    roots = []
    for members in groups.values():
        if len(members) == 1:
            ids, leaf = members[0]
            leaf.node, leaf.feed = engine.add_prompt([]), list(ids)
            roots.append(leaf)
            continue
        first = members[0][0]
        common = min(len(ids) - 1 for ids, _ in members)  # each fork feeds >= 1 token
        for ids, _ in members:
            common = next((j for j in range(common) if ids[j] != first[j]), common)
        for ids, leaf in members:
            leaf.feed = list(ids[common:])
        roots.append(Branch(engine.add_prompt([]), feed=list(first[:common]), then=[m[1] for m in members]))
    return roots


def prefill(engine: TreeEngine, prompts: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
    """Prefill ``prompts`` (shared prefixes once, in chunks); per prompt its node and last logits."""
    leaves = [Branch(None, finish_reason="prefill") for _ in prompts]
    with release_on_error(engine):
        decode(engine, prompt_branches(engine, list(zip(prompts, leaves))))
    return [(b.node, b.logits) for b in leaves]


def _leaves(engine: TreeEngine, req: Request) -> Branch:
    """The branch that prefills ``req``'s prompt; its ``n`` samples are ``req.branches``."""
    p = req.params
    sampler, stop = Sampler(p, engine.device), p.stop_ids(engine.tokenizer)
    if req.n == 1:
        req.branches = [Branch(None, sampler, stop, p.max_new_tokens)]
        return req.branches[0]
    req.branches = [Branch(None, sampler, stop, p.max_new_tokens) for _ in range(req.n)]
    return Branch(None, then=req.branches)


def _sample(engine: TreeEngine, branches: list[Branch]) -> None:
    """Pick each branch's next token (one batched call per sampler) and finish branches."""
    groups: dict[int, list[Branch]] = {}
    for b in branches:
        groups.setdefault(id(b.sampler), []).append(b)
    for group in groups.values():
        tokens, logps = group[0].sampler(torch.stack([b.logits for b in group]))
        for b, t, lp in zip(group, tokens, logps):
            b.logits = None
            b.tokens.append(t)
            b.logprob += lp
            room = engine.position(b.node) < engine.max_positions  # can t still be fed?
            reason = ("stop" if t in b.stop_ids else
                      "length" if len(b.tokens) >= b.max_new_tokens or not room else None)
            if reason is None:
                b.feed = [t]
                continue
            b.finish_reason = reason
            if b.keep_last and room:
                b.feed = [t]
            else:
                b.done = True
                if not b.keep_last:
                    engine.cache.prune(b.node, release_unused_ancestors=True)


def run_requests(
    engine: TreeEngine,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    max_batch: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[list[GenerationResult]]:
    """Decode ``n`` branches per prompt; per prompt, ``n`` results in branch order.

    ``tokens_per_s`` in the results' stats counts new tokens over the call's wall time,
    prefill included, without the time ``engine.count_io`` bookkeeping took.
    """
    requests = [Request(p, n, params) for p in prompts]
    t0, steps0, io0 = time.perf_counter(), engine.stats["steps"], engine.stats["io_s"]
    with release_on_error(engine):
        decode(engine, requests=requests, max_batch=max_batch, progress=progress)
    seconds = time.perf_counter() - t0 - (engine.stats["io_s"] - io0)
    new = sum(len(b.tokens) for r in requests for b in r.branches)
    call = {"seconds": seconds, "new_tokens_total": new, "steps": engine.stats["steps"] - steps0,
            "tokens_per_s": new / seconds if seconds > 0 else float("nan")}
    tok = engine.tokenizer
    return [[GenerationResult(b.tokens, tok.decode(b.tokens, skip_special_tokens=True), b.logprob,
                              {"finish_reason": b.finish_reason, "prompt_tokens": len(r.prompt),
                               **call})
             for b in r.branches] for r in requests]
