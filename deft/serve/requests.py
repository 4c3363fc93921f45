"""From a validated OpenAI request body to scheduler jobs, or an :class:`ApiError` naming
the parameter: every check happens here, before anything reaches the engine."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from ..engine import SamplingParams, TopKShape, TreeShape
from ..model.tokenizer import Tokenizer
from .jobs import Job

__all__ = ["ApiError", "Limits", "completion_jobs"]

MAX_STOP = 16
CHAT_MAX_TOKENS = 1024  # a chat request without max_tokens: the rest of the context, at most this
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions


class ApiError(Exception):
    """An HTTP error answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


@dataclass(frozen=True)
class Limits:
    """What the server can take: its model name, context, KV pages and drafters."""

    model: str
    context: int
    num_pages: int
    page_size: int
    drafters: set[str]


def completion_jobs(body: Any, prompts: list[list[int]], top: int | None, limits: Limits,
                    tokenizer: Tokenizer, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop,
                    chat: bool) -> list[Job]:
    """One job per prompt of ``body`` (a :class:`CompletionRequest` or :class:`ChatRequest`)."""
    if body.model != limits.model:
        raise ApiError(400, f"model: expected {limits.model!r} (see /v1/models), got {body.model!r}",
                       "model", "model_not_found")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ApiError(400, f"{name}: not supported, expected 0", name)
    if getattr(body, "echo", False):
        raise ApiError(400, "echo: not supported, expected false", "echo")
    stop = body.stop_strings()
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise ApiError(400, f"stop: expected at most {MAX_STOP} non-empty strings", "stop")
    param = "messages" if chat else "prompt"
    if not prompts:
        raise ApiError(400, f"{param}: expected a prompt or a non-empty list of prompts, got []", param)
    for i, ids in enumerate(prompts):
        if not ids:
            raise ApiError(400, f"{param}: prompt {i} encodes to no tokens", param)
        if any(t < 0 or t >= tokenizer.vocab_size for t in ids):
            raise ApiError(400, f"{param}: prompt {i} has a token id outside [0, {tokenizer.vocab_size})", param)
        if len(ids) >= limits.context:
            raise ApiError(400, f"{param}: {len(ids)} prompt tokens leave no room in the model's context "
                           f"of {limits.context}", param, "context_length_exceeded")
    longest = max(len(p) for p in prompts)
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = min(CHAT_MAX_TOKENS, limits.context - longest) if chat else COMPLETION_MAX_TOKENS
    if longest + max_tokens > limits.context:
        raise ApiError(400, f"max_tokens: {longest} prompt tokens + {max_tokens} exceed the model's "
                       f"context of {limits.context}", "max_tokens", "context_length_exceeded")
    n, best_of = body.n, body.best_of or body.n
    if best_of < n:
        raise ApiError(400, f"best_of: expected at least n={n}, got {best_of}", "best_of")
    kind, options = _strategy(body, n, best_of, top, limits)
    if body.stream and best_of > n and kind == "sample":
        raise ApiError(400, "best_of: a streamed request needs best_of == n", "best_of")
    temperature = 1.0 if body.temperature is None else body.temperature
    if kind == "beam":
        temperature = 0.0
    seed = body.seed
    if seed is None and temperature > 0:  # a preempted request recomputes the same tokens
        seed = random.getrandbits(63)
    stop_ids = None
    if body.stop_token_ids is not None:
        if any(t < 0 or t >= tokenizer.vocab_size for t in body.stop_token_ids):
            raise ApiError(400, "stop_token_ids: expected ids of the vocabulary", "stop_token_ids")
        stop_ids = tokenizer.eos_token_ids | set(body.stop_token_ids)
    try:
        params = SamplingParams(temperature=temperature, top_k=body.top_k or 0,
                                top_p=1.0 if body.top_p is None else body.top_p,
                                seed=seed if temperature > 0 else None, max_new_tokens=max_tokens,
                                stop_token_ids=stop_ids)
    except ValueError as exc:
        raise ApiError(400, str(exc), str(exc).partition(":")[0]) from exc
    width = options.get("num_beams", best_of)
    ps = limits.page_size
    worst = -(-longest // ps) + 1 + width * (-(-max_tokens // ps) + 2)
    if kind == "beam":
        worst += width * (-(-max_tokens // ps) + 2)  # beams fork and prune as they go
    if worst > limits.num_pages:
        raise ApiError(400, f"max_tokens: the request may need {worst} KV pages, more than the "
                       f"server's {limits.num_pages} KV pages", "max_tokens")
    return [Job(ids, n, params, stop, queue, loop, top_logprobs=top, best_of=best_of, kind=kind,
                options=options, base_index=i * n) for i, ids in enumerate(prompts)]


def _strategy(body: Any, n: int, best_of: int, top: int | None, limits: Limits) -> tuple[str, dict]:
    """``"sample"``, ``"beam"`` or ``"speculative"``, and the options the strategy takes."""
    if body.use_beam_search:
        if body.speculative is not None:
            raise ApiError(400, "speculative: not with use_beam_search", "speculative")
        if body.temperature not in (None, 0):
            raise ApiError(400, "temperature: beam search is deterministic, expected 0 or unset",
                           "temperature")
        if top is not None:
            raise ApiError(400, "logprobs: not available with use_beam_search", "logprobs")
        return "beam", {"num_beams": best_of, "length_penalty": body.length_penalty,
                        "early_stopping": body.early_stopping}
    if body.speculative is None:
        return "sample", {}
    spec = body.speculative
    if n != 1 or best_of != 1:
        raise ApiError(400, f"n: speculative decoding gives one choice, got n={n}", "n")
    if top is not None:
        raise ApiError(400, "logprobs: not available with speculative decoding", "logprobs")
    if spec.drafter not in limits.drafters:
        raise ApiError(400, f"speculative.drafter: expected one of {sorted(limits.drafters)} "
                       "(start the server with --draft-model for 'model')", "speculative.drafter")
    try:
        if spec.tree is None:
            tree = None
        elif isinstance(spec.tree, dict):
            tree = TopKShape(**spec.tree)
        else:
            tree = TreeShape.from_choices(spec.tree)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"speculative.tree: {exc}", "speculative.tree") from exc
    return "speculative", {"drafter": spec.drafter, "tree": tree}
