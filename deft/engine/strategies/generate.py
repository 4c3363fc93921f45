"""Generation and parallel sampling: every request of a batch advanced in one forward per step."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ...checks import int_at_least
from ..core import TreeEngine
from ..decoding import Request, decode, release_on_error
from ..prompts import Prompt, as_prompts
from ..params import GenerationResult, SamplingParams

__all__ = ["generate", "sample"]


def generate(
    engine: TreeEngine,
    prompts: Prompt | Sequence[Prompt],
    params: SamplingParams | None = None,
    max_batch: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[GenerationResult]:
    """One continuation per prompt (greedy by default); one result per prompt, in order.

    ``prompts``: text or token ids, one or a list. All running requests advance in one
    forward per step; with ``max_batch`` at most that many run at once and the next
    prompt's prefill shares a forward with the others' decode tokens. ``score`` is the
    sum of the model's log-probabilities of the generated tokens.
    """
    params = _check(params, max_batch)
    batch = as_prompts(prompts, engine)
    return [r[0] for r in _run_requests(engine, batch, 1, params, max_batch, progress)]


def sample(
    engine: TreeEngine,
    prompts: Prompt | Sequence[Prompt],
    n: int,
    params: SamplingParams | None = None,
    max_batch: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[list[GenerationResult]]:
    """``n`` samples per prompt; per prompt a list of ``n`` results.

    The ``n`` branches fork from the prompt's node after its prefill and share its K/V
    (nothing is copied); their first tokens are drawn from the prompt's last logits.
    """
    n = int_at_least(n, "n", 1)
    params = _check(params, max_batch)
    return _run_requests(engine, as_prompts(prompts, engine), n, params, max_batch, progress)


def _check(params: SamplingParams | None, max_batch: int | None) -> SamplingParams:
    if params is not None and not isinstance(params, SamplingParams):
        raise TypeError(f"params: expected SamplingParams or None, got {type(params).__name__}")
    int_at_least(max_batch, "max_batch", 1, or_none=True)
    return params or SamplingParams()


def _run_requests(
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
