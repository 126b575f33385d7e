"""The router's HTTP app: OpenAI routes proxied to a worker chosen by the policy, and its own routes.

Proxied: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming or not), ``GET /v1/models``.
A request that never started on its worker (the connection was refused or timed out, or the worker
answered 503: draining, engine down) is sent to another healthy worker, up to ``max_attempts``
workers; one that had started when its worker failed (the connection broke, or the health check
declared the worker dead) ends with an error: a 502 OpenAI error object, or, once a stream's
headers are out, an in-band SSE error event and ``data: [DONE]`` — never a hang.

Own routes: ``GET /health`` (200 while some worker is healthy, else 503), ``GET /workers``,
``POST /add_worker?url=...`` and ``POST /remove_worker?url=...`` (SGLang's router's), ``GET /metrics``
(Prometheus, per worker: routed requests, predicted and engine-reported cached tokens, load).
``--api-key`` guards every route but /health (401 in the OpenAI error shape).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from idleless.router.metrics import render_metrics
from idleless.router.policies import Policy, RouteInput
from idleless.router.prompts import PromptTokenizer, route_text
from idleless.router.workers import Worker, WorkerPool
from idleless.server.asgi import APIKeyMiddleware
from idleless.server.protocol import error_body

log = logging.getLogger("idleless.router")

SSE_DONE = b"data: [DONE]\n\n"
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
# response headers that describe the upstream connection, not the answer
_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "date", "server"}


async def read_json_object(request: Request) -> tuple[bytes, Optional[dict]]:
    """The request's raw body and its JSON object (None when it is not JSON or not an object)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        return raw, None
    return raw, body if isinstance(body, dict) else None


class WorkerDied(Exception):
    """The worker serving a request was declared dead."""


@dataclass
class RouterSettings:
    """``api_key``: required from clients (None: open); ``worker_headers``: sent to workers instead of
    the client's Authorization (a worker API key); ``max_attempts``: workers tried per request;
    ``track_cache_hits``: tokenize every request whatever the policy and count, per worker, the prompt
    tokens the chosen worker held and, over all workers, the most any healthy worker held (the
    oracle's hits) — for comparing policies."""

    api_key: Optional[str] = None
    worker_headers: dict = field(default_factory=dict)
    max_attempts: int = 3
    track_cache_hits: bool = False


def _error(status: int, message: str, code: str, type_: str = "server_error") -> JSONResponse:
    return JSONResponse(error_body(message, type_, None, code), status_code=status)


def _sse_error(message: str, code: str) -> bytes:
    return b"data: " + json.dumps(error_body(message, "server_error", None, code)).encode() + b"\n\n"


async def _until_dead(aw, dead: asyncio.Event):
    """Await ``aw``; raise WorkerDied (cancelling it) if ``dead`` is set first."""
    if dead.is_set():
        if asyncio.iscoroutine(aw):
            aw.close()
        raise WorkerDied
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(dead.wait())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise WorkerDied


class Router:
    """The proxy's logic, independent of FastAPI: pick, send, retry, stream back."""

    def __init__(self, pool: WorkerPool, policy: Policy, settings: RouterSettings,
                 tokenizer: Optional[PromptTokenizer] = None):
        self.pool = pool
        self.policy = policy
        self.settings = settings
        self.tokenizer = tokenizer
        self._keys = itertools.count()
        self.oracle_hit_tokens = 0  # with track_cache_hits (or the exact policy): the most any worker held

    def _headers(self, request: Request) -> dict:
        h = {"content-type": "application/json"}
        auth = request.headers.get("authorization")
        if self.settings.worker_headers:
            h.update(self.settings.worker_headers)
        elif auth and not self.settings.api_key:
            h["authorization"] = auth  # an open router passes the client's key on to the workers
        return h

    async def route_input(self, body: dict) -> RouteInput:
        """The request as the policy sees it (token ids only when the policy or the hit count needs them)."""
        tokens = None
        if (self.policy.needs_tokens or self.settings.track_cache_hits) and self.tokenizer is not None:
            tokens = await asyncio.to_thread(self.tokenizer.tokens, body)
        return RouteInput(route_text(body), tokens)

    async def proxy(self, request: Request, path: str) -> Response:
        """Forward a client's POST to ``path``; 400 when the body is not a JSON object."""
        raw, body = await read_json_object(request)
        if body is None:
            return _error(400, "the body is not a JSON object", "invalid_json", "invalid_request_error")
        return await self.forward(raw, body, self._headers(request), path)

    async def forward(self, raw: bytes, body: dict, headers: dict, path: str) -> Response:
        """Send ``raw`` (the JSON of ``body``) to a worker the policy picks, retrying workers it never
        started on; the answer streamed back or whole, or an OpenAI error (502 / 503)."""
        inp = await self.route_input(body)
        tried: set[str] = set()
        for _ in range(self.settings.max_attempts):
            candidates = [w for w in self.pool.healthy() if w.url not in tried]
            if not candidates:
                break
            w, cached = self.policy.select(candidates, inp)
            if inp.tokens:
                held = [c.cached_prefix(inp.tokens) for c in candidates]
                cached = held[candidates.index(w)]
                self.oracle_hit_tokens += max(held)
            tried.add(w.url)
            key = next(self._keys)
            w.begin(key, inp.tokens, cached)
            try:
                req = self.pool.client.build_request("POST", w.url + path, content=raw, headers=headers)
                resp = await _until_dead(self.pool.client.send(req, stream=True), w.dead)
            except (httpx.ConnectError, httpx.ConnectTimeout, WorkerDied) as e:
                w.finish(key)
                w.retries += 1
                log.warning("worker %s did not take the request (%s); trying another", w.url, type(e).__name__)
                if not isinstance(e, WorkerDied):
                    w.mark(False, dead=True)  # nothing listens: the health loop brings it back when it answers
                continue
            except httpx.HTTPError as e:
                w.finish(key)
                w.errors += 1
                return _error(502, f"worker {w.url} failed: {type(e).__name__}", "worker_failed")
            if resp.status_code == 503:  # not started there: draining, or its engine is down
                await resp.aclose()
                w.finish(key)
                w.retries += 1
                continue
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                return self._stream(w, key, resp)
            try:
                content = await _until_dead(resp.aread(), w.dead)
            except (httpx.HTTPError, WorkerDied) as e:
                w.errors += 1
                return _error(502, f"worker {w.url} failed while answering: {type(e).__name__}", "worker_failed")
            finally:
                await resp.aclose()
                w.finish(key)
            w.last_progress = time.monotonic()
            m = _CACHED.search(content)
            if m:
                w.cached_tokens += int(m.group(1))
            return Response(content, status_code=resp.status_code, headers=self._pass_headers(resp))
        return _error(503, "no healthy worker could take the request", "no_healthy_workers")

    @staticmethod
    def _pass_headers(resp: httpx.Response) -> dict:
        return {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}

    def _stream(self, w: Worker, key: int, resp: httpx.Response) -> StreamingResponse:
        async def body():
            ended = False
            chunks = resp.aiter_raw()
            try:
                while True:
                    try:
                        chunk = await _until_dead(chunks.__anext__(), w.dead)
                    except StopAsyncIteration:
                        break
                    w.started(key)
                    w.last_progress = time.monotonic()
                    ended = ended or chunk.rstrip().endswith(b"[DONE]")
                    m = _CACHED.search(chunk)
                    if m:
                        w.cached_tokens += int(m.group(1))
                    yield chunk
                if not ended:  # the worker closed the stream early: say so
                    raise httpx.RemoteProtocolError("the stream ended without [DONE]")
            except (httpx.HTTPError, WorkerDied) as e:
                w.errors += 1
                log.warning("stream from %s broke: %s", w.url, type(e).__name__)
                yield _sse_error(f"worker {w.url} failed mid-stream ({type(e).__name__})", "worker_failed")
                yield SSE_DONE
            finally:
                await resp.aclose()
                w.finish(key)

        return StreamingResponse(body(), status_code=resp.status_code, headers=self._pass_headers(resp),
                                 media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        """``GET /v1/models`` of the first healthy worker that answers; 503 when none does."""
        for w in self.pool.healthy():
            try:
                r = await self.pool.client.get(w.url + "/v1/models", headers=self._headers(request))
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, headers=self._pass_headers(r))
        return _error(503, "no healthy worker", "no_healthy_workers")


def proxy_app(title: str, api_key: Optional[str], proxy, models) -> FastAPI:
    """A FastAPI app with the proxied OpenAI routes: ``await proxy(request, path)`` for chat and
    completions, ``await models(request)`` for /v1/models; ``api_key`` guards every route but /health."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy(request, "/v1/completions")

    @app.get("/v1/models")
    async def v1_models(request: Request):
        return await models(request)

    return app


def build_app(router: Router) -> FastAPI:
    """The FastAPI app around ``router`` (its pool's health loop runs while the app is served)."""
    pool = router.pool
    app = proxy_app("idleless router", router.settings.api_key, router.proxy, router.models)

    @app.get("/health")
    async def health():
        if pool.healthy():
            return Response(status_code=200)
        return _error(503, "no healthy worker", "no_healthy_workers")

    @app.get("/workers")
    async def workers():
        return JSONResponse({"policy": router.policy.name, "workers": [w.describe() for w in pool.workers.values()]})

    @app.post("/add_worker")
    async def add_worker(url: str):
        w = await pool.add(url)
        return JSONResponse({"success": True, "url": w.url, "healthy": w.healthy})

    @app.post("/remove_worker")
    async def remove_worker(url: str):
        w = await pool.remove(url)
        if w is None:
            return _error(404, f"no worker {url!r}", "worker_not_found", "invalid_request_error")
        router.policy.on_removed(w.url)
        return JSONResponse({"success": True, "url": w.url})

    @app.get("/metrics")
    async def metrics():
        text, content_type = render_metrics(pool.workers.values(), router.policy.name, router.oracle_hit_tokens)
        return Response(text, media_type=content_type)

    return app
