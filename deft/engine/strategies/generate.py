"""Generation and parallel sampling: every request of a batch advanced in one forward per step."""

from __future__ import annotations

from typing import Callable, Sequence

from ...checks import int_at_least
from ..core import TreeEngine
from ..decoding import run_requests
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
    return [r[0] for r in run_requests(engine, batch, 1, params, max_batch, progress)]


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
    return run_requests(engine, as_prompts(prompts, engine), n, params, max_batch, progress)


def _check(params: SamplingParams | None, max_batch: int | None) -> SamplingParams:
    if params is not None and not isinstance(params, SamplingParams):
        raise TypeError(f"params: expected SamplingParams or None, got {type(params).__name__}")
    int_at_least(max_batch, "max_batch", 1, or_none=True)
    return params or SamplingParams()
