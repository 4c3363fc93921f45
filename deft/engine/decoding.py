"""The decode loop shared by ``generate``, ``sample`` and ``tree_search``.

A :class:`Branch` is one sequence growing from a cache node. Each step, every live
branch of every request feeds its pending tokens (a prompt, a prefix, or the token it
sampled last) in ONE ``engine.extend``; then all branches sample their next token, one
batched call per sampler. A finished branch releases its K/V at once
(``prune(release_unused_ancestors=True)``), unless it keeps its last token for children
(``keep_last``, tree search).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .core import GenerationResult, SamplingParams, TreeEngine
from .sampling import Sampler

__all__ = ["Branch", "Request", "as_prompts", "decode", "run_requests"]

Prompt = str | Sequence[int]


@dataclass(eq=False)
class Branch:
    """One sequence decoded from ``node``.

    ``feed`` holds tokens to compute next step; ``logits`` ``[vocab]`` is the row to
    sample from when ``feed`` is empty. ``fan_out > 1`` turns the branch, once its feed
    is computed, into that many forks of its node sampled from the same logits.
    """

    node: int
    sampler: Sampler | None  # None: never samples (a prefix-only branch)
    stop_ids: frozenset[int]
    max_new_tokens: int
    feed: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    keep_last: bool = False
    fan_out: int = 1
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    finish_reason: str | None = None
    done: bool = False
    children: list[Branch] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """A prompt decoded into ``n`` branches that share its K/V."""

    prompt: list[int]
    n: int
    params: SamplingParams
    branches: list[Branch] = field(default_factory=list)


def as_prompts(prompts: Prompt | Sequence[Prompt], engine: TreeEngine) -> list[list[int]]:
    """A batch of token-id prompts from one prompt or many (text is encoded)."""
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts: expected a prompt or a non-empty list of prompts, got {prompts!r}")
    out = []
    for i, p in enumerate(prompts):
        ids = engine.tokenizer.encode(p) if isinstance(p, str) else p
        if not isinstance(ids, Sequence) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"prompts[{i}]: expected text or a non-empty list of token ids, got {p!r}")
        if len(ids) > engine.max_positions:
            raise ValueError(f"prompts[{i}]: the prompt has {len(ids)} tokens, more than the "
                             f"model's context of {engine.max_positions}")
        out.append(list(ids))
    return out


def decode(
    engine: TreeEngine,
    branches: Sequence[Branch] = (),
    requests: Sequence[Request] = (),
    max_batch: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Run ``branches`` and ``requests`` to completion, one forward per step.

    Requests are admitted in order while fewer than ``max_batch`` are running (all at
    once by default); an admitted prompt is prefilled in the same forward as the other
    requests' decode tokens. ``progress(n)`` is called with the tokens sampled each step.
    """
    waiting, live, running = deque(requests), list(branches), []
    while True:
        ready = [b for b in live if not b.done and b.logits is not None]
        if ready:
            _sample(engine, ready)
            if progress is not None:
                progress(len(ready))
        live = [b for b in live if not b.done]
        running = [r for r in running if any(not b.done for b in r.branches)]
        admit = []
        while waiting and (max_batch is None or len(running) + len(admit) < max_batch):
            admit.append(waiting.popleft())
        for req, node in zip(admit, _place_prompts(engine, [r.prompt[:-1] for r in admit])):
            req.branches = [Branch(node, Sampler(req.params, engine.device),
                                   req.params.stop_ids(engine.tokenizer),
                                   req.params.max_new_tokens, feed=req.prompt[-1:], fan_out=req.n)]
            live += req.branches
        running += admit
        feeding = [b for b in live if b.feed]
        if not feeding:
            return
        rows = engine.extend([(b.node, b.feed) for b in feeding], logits="last")
        for b, row in zip(feeding, rows):
            b.feed, b.logits = [], row
            if b.finish_reason is not None:  # a kept last token: its logits are the result
                b.done = True
            elif b.fan_out > 1:
                b.children = [Branch(n, b.sampler, b.stop_ids, b.max_new_tokens, logits=row,
                                     keep_last=b.keep_last)
                              for n in engine.cache.fork(b.node, b.fan_out)]
                b.done, b.logits = True, None
                live += b.children
        for req in running:
            if len(req.branches) == 1 and req.branches[0].children:
                req.branches = req.branches[0].children


def _place_prompts(engine: TreeEngine, prompts: list[list[int]]) -> list[int]:
    """A childless node per prompt, all queued for the next forward, sharing common prefixes.

    Prompts that agree on their first ``page_size`` tokens form a group: the group's
    longest common prefix becomes one root and each prompt a fork of it holding the rest,
    so the shared part is computed once and read once per step (a system prompt, a
    few-shot preamble). Other prompts get a root of their own.
    """
    share = engine.pool.page_size
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p[:share]) if len(p) >= share else (-1 - i,), []).append(i)
    nodes = [0] * len(prompts)
    for members in groups.values():
        if len(members) == 1:
            nodes[members[0]] = engine.add_prompt(prompts[members[0]])
            continue
        first = prompts[members[0]]
        common = min(next((j for j, t in enumerate(first[:len(p)]) if p[j] != t), min(len(p), len(first)))
                     for p in (prompts[i] for i in members))
        root = engine.add_prompt(first[:common])
        for i, node in zip(members, engine.cache.fork(root, len(members))):
            engine.append(node, prompts[i][common:])
            nodes[i] = node
    return nodes


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
    """Decode ``n`` branches per prompt; per prompt, ``n`` results in branch order."""
    requests = [Request(p, n, params) for p in prompts]
    t0, tokens0 = time.perf_counter(), engine.stats["steps"]
    decode(engine, requests=requests, max_batch=max_batch, progress=progress)
    seconds = time.perf_counter() - t0
    new = sum(len(b.tokens) for r in requests for b in r.branches)
    call = {"seconds": seconds, "new_tokens_total": new, "steps": engine.stats["steps"] - tokens0,
            "tokens_per_s": new / seconds if seconds > 0 else float("nan")}
    tok = engine.tokenizer
    return [[GenerationResult(b.tokens, tok.decode(b.tokens, skip_special_tokens=True), b.logprob,
                              {"finish_reason": b.finish_reason, "prompt_tokens": len(r.prompt),
                               **call})
             for b in r.branches] for r in requests]
