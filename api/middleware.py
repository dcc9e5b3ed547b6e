"""The gateway's ASGI middleware: request metrics with last-resort errors, and the body limit.

Both are plain ASGI (no ``BaseHTTPMiddleware``): the ``receive`` a route sees
is the server's own, so a route can wait for ``http.disconnect`` while its
answer is generated (``api.app``).

``RequestMetrics`` counts every response and turns an exception no handler
took into a 500 in the OpenAI error shape *here*, inside Starlette's
``ServerErrorMiddleware``, which would re-raise it and so close the client's
keep-alive connection.

``BodyLimit`` reads the body before the app does and answers 413 once it
passes ``RQ_API_MAX_BODY_BYTES`` (at once when ``Content-Length`` says so): a
body past the limit is never parsed, let alone sent to Redis.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_queue.api import errors
from rollout_queue.api.metrics import GatewayMetrics
from rollout_queue.tasks.errors import RequestTooLarge

log = logging.getLogger("rollout_queue.api")


class RequestMetrics:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, endpoints: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        path = scope["path"] if scope["path"] in self.endpoints else "other"
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if status:  # the response had started: nothing left to answer with
                raise
            log.exception("unhandled error on %s", path)
            await errors.from_exception(exc)(scope, receive, sending)
        finally:
            self.metrics.requests.labels(endpoint=path, status=str(status or 500)).inc()
            self.metrics.request_seconds.labels(endpoint=path).observe(time.perf_counter() - started)


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"{declared} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone before its body was in
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the server's own (http.disconnect)

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        error = RequestTooLarge(
            f"the request body has {size}; this gateway takes at most {self.max_bytes} "
            "(RQ_API_MAX_BODY_BYTES)"
        )
        await errors.from_exception(error)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    headers: Any = scope.get("headers") or []
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
