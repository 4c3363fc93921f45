"""From a validated OpenAI request body to scheduler jobs, or an :class:`ApiError` naming
the parameter: every check happens here, before anything reaches the engine."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from ..checks import context_text
from ..engine import SamplingParams, TopKShape, TreeShape
from ..model.tokenizer import Tokenizer
from .jobs import Job

__all__ = ["ApiError", "Limits", "chat_prompt", "check_model", "completion_jobs", "completion_prompts"]

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
    """What the server can take: its model name, context, KV pages, drafters and draft tokens."""

    model: str
    context: int
    num_pages: int
    page_size: int
    drafters: dict[str, int]  # name -> draft tokens of its default tree
    max_draft_tokens: int | None = None  # None: any
    # "the model's context of N", and what capped it where something did (an engine's
    # ``context_text``), for the errors that quote it
    context_text: str = ""

    def __post_init__(self) -> None:
        if not self.context_text:
            object.__setattr__(self, "context_text", context_text(self.context))


def check_model(model: str, limits: Limits) -> None:
    """A 404 unless ``model`` is the server's."""
    if model != limits.model:
        raise ApiError(404, f"model: expected {limits.model!r} (see /v1/models), got {model!r}",
                       "model", "model_not_found", "not_found_error")


def completion_prompts(body: Any, tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of each prompt of a :class:`CompletionRequest`."""
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [tokenizer.encode(_text(p, "prompt")) if isinstance(p, str) else list(p) for p in prompts]


def chat_prompt(body: Any, tokenizer: Tokenizer) -> list[int]:
    """The token ids of a :class:`ChatRequest`'s messages, rendered by the chat template."""
    try:
        messages = [{"role": m.role, "content": _text(m.text(), f"messages[{i}].content")}
                    for i, m in enumerate(body.messages)]
        return tokenizer.apply_chat_template(messages)
    except ValueError as exc:
        raise ApiError(400, str(exc), "messages") from exc


def _text(text: str, param: str) -> str:
    """``text``, or a 400 naming ``param`` if it holds a lone surrogate (JSON's ``"\\ud800"``),
    which no UTF-8 tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{param}: a lone surrogate U+{ord(text[exc.start]):04X} at character "
                       f"{exc.start} is not Unicode text", param) from None
    return text


def completion_jobs(body: Any, prompts: list[list[int]], top: int | None, limits: Limits,
                    tokenizer: Tokenizer, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop,
                    chat: bool) -> list[Job]:
    """One job per prompt of ``body`` (a :class:`CompletionRequest` or :class:`ChatRequest`)."""
    stop = body.stop_strings()
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise ApiError(400, f"stop: expected at most {MAX_STOP} non-empty strings", "stop")
    param = "messages" if chat else "prompt"
    if not prompts:
        raise ApiError(400, f"{param}: expected a prompt or a non-empty list of prompts, got []", param)
    for i, ids in enumerate(prompts):
        if not ids:
            raise ApiError(400, f"{param}: prompt {i} encodes to no tokens", param)
        if len(ids) >= limits.context:
            raise ApiError(400, f"{param}: {len(ids)} prompt tokens leave no room in "
                           f"{limits.context_text}", param, "context_length_exceeded")
        if any(t < 0 or t >= tokenizer.vocab_size for t in ids):
            raise ApiError(400, f"{param}: prompt {i} has a token id outside [0, {tokenizer.vocab_size})", param)
    longest = max(len(p) for p in prompts)
    max_tokens = body.max_tokens
    if chat:
        if body.max_completion_tokens is not None:  # OpenAI's newer name wins, as in vLLM
            max_tokens = body.max_completion_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    if max_tokens is None:
        max_tokens = min(CHAT_MAX_TOKENS, limits.context - longest) if chat else COMPLETION_MAX_TOKENS
    if longest + max_tokens > limits.context:
        raise ApiError(400, f"max_tokens: {longest} prompt tokens + {max_tokens} exceed "
                       f"{limits.context_text}", "max_tokens", "context_length_exceeded")
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
        if body.stop:
            raise ApiError(400, "stop: not available with use_beam_search (stop_token_ids are)", "stop")
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
    drafts = limits.drafters[spec.drafter] if tree is None else tree.num_drafts
    if limits.max_draft_tokens is not None and drafts > limits.max_draft_tokens:
        given = "" if tree is not None else f" (the {spec.drafter} drafter's default tree)"
        raise ApiError(400, f"speculative.tree: {drafts} draft tokens{given}, more than the "
                       f"server's {limits.max_draft_tokens} (--max-draft-tokens)", "speculative.tree")
    return "speculative", {"drafter": spec.drafter, "tree": tree}
