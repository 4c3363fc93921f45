"""The FastAPI application: OpenAI's routes over a :class:`~deft.serve.scheduler.Scheduler`.

Handlers validate a request, turn it into jobs (one per prompt; prompts are tokenised off
the event loop), submit them, and either stream their deltas as server-sent events
(ending with ``data: [DONE]``) or gather them into one response. A client that goes away
cancels its jobs at once, streamed or not. Errors are OpenAI's error object: 400 bad
input, 401 a wrong API key, 404 an unknown route or model, 413 a body over the limit, 429
a full queue, 503 a server shutting down.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .gate import Gate
from .jobs import Delta, End, Job
from .protocol import ChatRequest, CompletionRequest, error_body
from .requests import ApiError, Limits, chat_prompt, check_model, completion_jobs, completion_prompts
from .scheduler import Scheduler

__all__ = ["create_app"]


def create_app(scheduler: Scheduler, model_name: str, api_key: str | None = None,
               max_request_bytes: int | None = None, max_draft_tokens: int | None = None) -> FastAPI:
    """The server's application; ``scheduler`` must be started (and stopped) by the caller.
    ``max_request_bytes`` bounds a request's body (413), ``max_draft_tokens`` a speculative
    draft tree (400); ``None``: no bound."""
    app = FastAPI(title="deft serve", docs_url=None, redoc_url=None)
    app.add_middleware(Gate, api_key=api_key, max_body=max_request_bytes)
    engine = scheduler.engine
    limits = Limits(model_name, engine.max_positions, engine.cache.num_pages, engine.config.page_size,
                    {name: (getattr(make, "default_shape", None) or make().default_shape).num_drafts
                     for name, make in scheduler.drafters.items()}, max_draft_tokens,
                    engine.context_text)
    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "deft"}

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

    @app.get("/health")
    async def health() -> Any:
        if scheduler.fatal is not None:
            return JSONResponse(error_body(f"the engine stopped: {scheduler.fatal}", "server_error"),
                                503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(scheduler.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        check_model(model, limits)
        return card

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model, limits)
        prompts = lambda: completion_prompts(body, engine.tokenizer)  # noqa: E731
        return await _respond(scheduler, request, body, prompts, body.logprobs, "text_completion", limits)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        check_model(body.model, limits)
        top = (body.top_logprobs or 0) if body.logprobs else None
        prompts = lambda: [chat_prompt(body, engine.tokenizer)]  # noqa: E731
        return await _respond(scheduler, request, body, prompts, top, "chat.completion", limits)

    return app


async def _respond(scheduler: Scheduler, request: Request, body: Any, prompts: Callable[[], list[list[int]]],
                   top: int | None, kind: str, limits: Limits) -> Response:
    """Tokenise (off the loop), submit the jobs and answer: streamed or whole."""
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    jobs = await asyncio.to_thread(lambda: completion_jobs(
        body, prompts(), top, limits, scheduler.engine.tokenizer, queue, loop, chat=kind == "chat.completion"))
    room = scheduler.max_running + scheduler.max_queue
    if len(jobs) > room:
        raise ApiError(400, f"prompt: {len(jobs)} prompts, more than the server takes at once "
                       f"({room}: --max-running plus --max-queue)", "prompt")
    if not scheduler.submit(jobs):
        if scheduler.closed:
            raise ApiError(503, "the server is shutting down", None, "service_unavailable", "server_error")
        raise ApiError(429, f"the server's queue is full ({scheduler.max_queue} requests wait); "
                       "retry later", None, "rate_limit_exceeded", "rate_limit_error")
    head = {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()), "model": body.model}
    fmt = _Format(scheduler.engine.tokenizer, kind, top)
    if body.stream:  # (Starlette's streaming response ends the stream when the client leaves)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_stream(scheduler, jobs, queue, head, fmt, body.n, include_usage),
                                 media_type="text/event-stream")
    choices: dict[int, dict] = {}
    usage = [0, 0]
    open_jobs = set(jobs)
    watch = asyncio.ensure_future(_left(request, lambda: [scheduler.cancel(j) for j in jobs]))
    try:
        async for ev in _events(queue, open_jobs, usage):
            if isinstance(ev, ApiError):
                raise ev
            fmt.gather(choices.setdefault(ev.index, {"text": "", "logprobs": [], "finish": None}), ev)
    finally:
        watch.cancel()
        for job in open_jobs:
            scheduler.cancel(job)
    out = [fmt.choice(i, c) for i, c in sorted(choices.items())]
    return JSONResponse({**head, "object": kind, "choices": out, "usage": _usage(*usage)})


async def _left(request: Request, cancel: Callable[[], Any]) -> None:
    """Call ``cancel`` when the client of ``request`` (whose body was read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel()


async def _stream(scheduler: Scheduler, jobs: list[Job], queue: asyncio.Queue, head: dict,
                  fmt: _Format, n: int, include_usage: bool) -> AsyncIterator[str]:
    open_jobs, usage = set(jobs), [0, 0]
    obj = head | {"object": fmt.chunk_object}
    try:
        if fmt.chat:
            for i in range(len(jobs) * n):
                yield _sse(obj | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
        async for ev in _events(queue, open_jobs, usage):
            if isinstance(ev, ApiError):
                yield _sse(error_body(ev.message, ev.type, None, str(ev.status)))
                break
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


async def _events(queue: asyncio.Queue, open_jobs: set[Job], usage: list[int]
                  ) -> AsyncIterator[Delta | ApiError]:
    """The jobs' deltas as they come off ``queue``. A finished job leaves ``open_jobs`` and
    adds its tokens to ``usage`` (prompt, completion); a failed one's error is the last item."""
    while open_jobs:
        job, ev = await queue.get()
        if not isinstance(ev, End):
            yield ev
            continue
        open_jobs.discard(job)
        if ev.error is not None:
            status, message = ev.error
            yield ApiError(status, message,
                           type_="server_error" if status >= 500 else "invalid_request_error")
            return
        usage[0] += ev.prompt_tokens
        usage[1] += ev.completion_tokens


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
