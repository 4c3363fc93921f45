"""The FastAPI application: OpenAI's routes over a :class:`~deft.serve.scheduler.Scheduler`.

Handlers validate a request, turn it into jobs (one per prompt), submit them, and either
stream their deltas as server-sent events (ending with ``data: [DONE]``) or gather them
into one response. A client that goes away cancels its jobs. Errors are OpenAI's error
object: 400 bad input, 401 a wrong API key, 404 an unknown route, 429 a full queue.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .jobs import Delta, End, Job
from .protocol import ChatRequest, CompletionRequest, error_body
from .requests import ApiError, Limits, completion_jobs
from .scheduler import Scheduler

__all__ = ["create_app"]

_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is there


def create_app(scheduler: Scheduler, model_name: str, api_key: str | None = None) -> FastAPI:
    """The server's application; ``scheduler`` must be started (and stopped) by the caller."""
    app = FastAPI(title="deft serve", docs_url=None, redoc_url=None)
    engine = scheduler.engine
    limits = Limits(model_name, engine.max_positions, engine.cache.num_pages, engine.config.page_size,
                    set(scheduler.drafters))
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        return JSONResponse(error_body(msg, "invalid_request_error", param, err.get("type")), 400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code)

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Response:
        if api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                body = error_body("invalid API key: expected the header Authorization: Bearer <key>",
                                  "invalid_request_error", None, "invalid_api_key")
                return JSONResponse(body, 401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(scheduler.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "deft"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        tok = engine.tokenizer
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        top = body.logprobs
        return await _respond(scheduler, request, body, ids, top, "text_completion", limits)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        tok = engine.tokenizer
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = tok.apply_chat_template(messages)
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from exc
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await _respond(scheduler, request, body, [ids], top, "chat.completion", limits)

    return app


async def _respond(scheduler: Scheduler, request: Request, body: Any, prompts: list[list[int]],
                   top: int | None, kind: str, limits: Limits) -> Response:
    """Submit the jobs of ``prompts`` and answer: streamed or whole."""
    queue: asyncio.Queue = asyncio.Queue()
    jobs = completion_jobs(body, prompts, top, limits, scheduler.engine.tokenizer, queue,
                           asyncio.get_running_loop(), chat=kind == "chat.completion")
    for i, job in enumerate(jobs):
        if not scheduler.submit(job):
            for j in jobs[:i]:
                scheduler.cancel(j)
            raise ApiError(429, f"the server's queue is full ({scheduler.max_queue} requests wait); "
                           "retry later", None, "rate_limit_exceeded", "rate_limit_error")
    head = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()), "model": body.model}
    fmt = _Format(scheduler.engine.tokenizer, kind, top)
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_stream(scheduler, jobs, queue, head, fmt, body.n, include_usage),
                                 media_type="text/event-stream")
    choices: dict[int, dict] = {}
    usage = [0, 0]
    open_jobs = set(jobs)
    try:
        while open_jobs:
            try:
                job, ev = await asyncio.wait_for(queue.get(), _POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            if isinstance(ev, End):
                open_jobs.discard(job)
                if ev.error is not None:
                    raise ApiError(ev.error[0], ev.error[1])
                usage[0] += ev.prompt_tokens
                usage[1] += ev.completion_tokens
            else:
                fmt.gather(choices.setdefault(ev.index, {"text": "", "logprobs": [], "finish": None}), ev)
    finally:
        for job in open_jobs:
            scheduler.cancel(job)
    out = [fmt.choice(i, c) for i, c in sorted(choices.items())]
    return JSONResponse({**head, "object": kind, "choices": out, "usage": _usage(*usage)})


async def _stream(scheduler: Scheduler, jobs: list[Job], queue: asyncio.Queue, head: dict,
                  fmt: _Format, n: int, include_usage: bool) -> AsyncIterator[str]:
    open_jobs, usage = set(jobs), [0, 0]
    obj = head | {"object": fmt.chunk_object}
    try:
        if fmt.chat:
            for i in range(len(jobs) * n):
                yield _sse(obj | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
        while open_jobs:
            job, ev = await queue.get()
            if isinstance(ev, End):
                open_jobs.discard(job)
                if ev.error is not None:
                    status, message = ev.error
                    yield _sse(error_body(message, "server_error" if status >= 500 else
                                          "invalid_request_error", None, str(status)))
                    break
                usage[0] += ev.prompt_tokens
                usage[1] += ev.completion_tokens
                continue
            if ev.text or ev.finish_reason or ev.logprobs:
                yield _sse(obj | {"choices": [fmt.chunk(ev)]} | ({"usage": None} if include_usage else {}))
        if include_usage and not open_jobs:
            yield _sse(obj | {"choices": [], "usage": _usage(*usage)})
        yield "data: [DONE]\n\n"
    finally:
        for job in open_jobs:
            scheduler.cancel(job)


class _Format:
    """OpenAI's response shapes for completions and chat, choices and chunks alike."""

    def __init__(self, tokenizer: Any, kind: str, top: int | None) -> None:
        self.tok, self.chat, self.top = tokenizer, kind == "chat.completion", top
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        self._offsets: dict[int, int] = {}  # per streamed choice: the text its chunks covered

    def gather(self, acc: dict, ev: Delta) -> None:
        acc["text"] += ev.text
        acc["logprobs"] += ev.logprobs
        acc["finish"] = ev.finish_reason or acc["finish"]

    def choice(self, index: int, acc: dict) -> dict:
        lp = self._logprobs(acc["logprobs"], 0)
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": acc["text"]},
                    "logprobs": lp, "finish_reason": acc["finish"]}
        return {"index": index, "text": acc["text"], "logprobs": lp, "finish_reason": acc["finish"]}

    def chunk(self, ev: Delta) -> dict:
        at = self._offsets.get(ev.index, 0)
        lp = self._logprobs(ev.logprobs, at)
        if lp is not None and not self.chat:
            self._offsets[ev.index] = at + sum(len(t) for t in lp["tokens"])
        if self.chat:
            return {"index": ev.index, "delta": {"content": ev.text} if ev.text else {},
                    "logprobs": lp, "finish_reason": ev.finish_reason}
        return {"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}

    def _logprobs(self, entries: list, offset: int) -> dict | None:
        if self.top is None:
            return None
        piece = lambda t: self.tok.decode([t])  # noqa: E731
        if self.chat:
            def entry(t: int, lp: float) -> dict:
                s = piece(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [entry(e.token, e.logprob) | {"top_logprobs": [entry(t, v) for t, v in e.top]}
                                for e in entries]}
        tokens = [piece(e.token) for e in entries]
        offsets, at = [], offset
        for s in tokens:
            offsets.append(at)
            at += len(s)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{piece(t): v for t, v in e.top} for e in entries], "text_offset": offsets}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
