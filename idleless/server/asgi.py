"""ASGI plumbing of the server: API-key check, client-disconnect detection, server-sent events.

Nothing here knows the routes: ``APIKeyMiddleware`` wraps the app, ``until_disconnect`` races an
awaitable against the client leaving, ``EventStreamResponse`` streams ``sse(...)`` strings and
cancels its producer when the client goes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from idleless.server.protocol import error_body
from idleless.telemetry.metrics import ServerMetrics

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class APIKeyMiddleware:
    """Pure ASGI middleware (it must not wrap ``receive``): ``Authorization: Bearer <key>`` on every
    HTTP route except ``open_paths``; otherwise 401 with the OpenAI error object."""

    def __init__(self, app, api_key: str, metrics: Optional[ServerMetrics] = None,
                 open_paths: tuple[str, ...] = ("/health",)):
        self.app = app
        self.expected = api_key.encode()
        self.metrics = metrics
        self.open_paths = set(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in self.open_paths:
            got = b""
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    got = v
                    break
            scheme, _, token = got.partition(b" ")  # the scheme is case-insensitive (RFC 7235 section 2.1)
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
                if self.metrics is not None:
                    self.metrics.observe_rejected("unauthorized")
                msg = "missing API key (Authorization: Bearer ...)" if not got else "incorrect API key"
                resp = JSONResponse(error_body(msg, "authentication_error", None, "invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, aw):
    """Await ``aw`` unless the client disconnects first (then cancel it and raise ClientGone).
    The request body must have been read already."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001
        pass
    raise ClientGone()


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of already formatted ``data: ...\\n\\n`` strings.

    Unlike Starlette's StreamingResponse it watches ``receive`` for ``http.disconnect`` the whole
    time (uvicorn's ``send`` silently drops writes to a closed connection, so writing alone would
    only notice at the next token): on disconnect the iterator is cancelled and closed, which
    aborts its engine requests."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str], headers: Optional[dict] = None):
        # no Response.__init__: it would declare Content-Length: 0
        self.status_code = 200
        self.background = None
        self.chunks = chunks
        hdrs = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                "x-accel-buffering": "no", **{k.lower(): v for k, v in (headers or {}).items()}}
        self.raw_headers = [(k.encode("latin-1"), str(v).encode("latin-1")) for k, v in hdrs.items()]

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump():
            try:
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await self.chunks.aclose()

        pump_task = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not pump_task.done():
                pump_task.cancel()
            try:
                await pump_task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - the client is gone or the stream broke; nothing to answer
                log.exception("stream ended with an error")


def sse(obj: Any) -> str:
    """One server-sent event: ``data: <JSON>`` and a blank line (pydantic models or plain JSON values)."""
    if hasattr(obj, "model_dump_json"):
        return f"data: {obj.model_dump_json()}\n\n"
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
