"""What every HTTP request passes before a route sees it: the API key and the body's size.

A plain ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one hides the
client's disconnect from the routes, and a route must see it to cancel what the client
left. The body is read here, up to ``max_body`` bytes (a 413 beyond, whatever the
``Content-Length`` said), and handed on to the route; what the route receives after it
is the connection's own (its disconnect).
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Awaitable, Callable

from .protocol import error_body

__all__ = ["Gate"]

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class Gate:
    """Wrap ``app``: ``/v1/*`` need ``Authorization: Bearer api_key`` (unless ``api_key`` is
    ``None``; 401 otherwise), and a body over ``max_body`` bytes (``None``: any) is a 413."""

    def __init__(self, app: Any, api_key: str | None, max_body: int | None) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return await _answer(send, 401, error_body(
                    "invalid API key: expected the header Authorization: Bearer <key>",
                    "invalid_request_error", None, "invalid_api_key"))
        if self.max_body is None:
            return await self.app(scope, receive, send)
        too_large = error_body(f"the request body exceeds the server's {self.max_body} bytes "
                               "(--max-request-bytes)", "invalid_request_error", None, "request_too_large")
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            return await _answer(send, 413, too_large)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return await _answer(send, 413, too_large)
            if not message.get("more_body", False):
                break
        body: list[dict] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict:
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)


async def _answer(send: Send, status: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
