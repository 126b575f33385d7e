"""The OpenAI-compatible server's FastAPI app: error handlers, the API key, and the route modules.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (``routes_openai``);
POST /generate (native: token ids in and out), POST /v1/tokenize, POST /v1/detokenize
(``routes_native``); GET /health, GET /metrics, GET /server_info, POST /flush_cache,
POST /pin_prefix, POST /unpin_prefix, and SGLang's GET /v1/loads, GET /get_model_info (also
/model_info) and GET /get_server_info (``routes_admin``).

Every error is the OpenAI error object ``{"error": {"message", "type", "param", "code"}}``:
400 for bad input (validated here, before the engine sees anything), 401 without the API key,
404/405 for unknown routes, 503 with ``Retry-After`` when overloaded or the engine is gone, 500
for an engine failure. Streams (``text/event-stream``, ``streaming``) start only once the first
output (or a refusal) came back, so a refusal is still a proper status code; each choice ends with
exactly one ``finish_reason``, then an optional usage chunk, then ``data: [DONE]``. A client that
disconnects (streaming or not) has its engine requests aborted at once.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from idleless.server import routes_admin, routes_native, routes_openai, routes_rl
from idleless.server.asgi import APIKeyMiddleware
from idleless.server.context import ServerContext, ServerSettings
from idleless.server.engine_client import EngineClient
from idleless.server.protocol import APIError, error_body
from idleless.telemetry.metrics import ServerMetrics

__all__ = ["ServerSettings", "build_app"]

log = logging.getLogger(__name__)


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if e.status == 503:
            metrics.observe_rejected("overloaded")
        elif 400 <= e.status < 500:
            metrics.observe_rejected("bad_request")
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(error_body(str(e.detail), "invalid_request_error", None, code),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(error_body(str(e.errors()[:1]), "invalid_request_error", None, "invalid_value"),
                            status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error", None, "internal_error"),
                            status_code=500)


def build_app(client: EngineClient, settings: ServerSettings, metrics: Optional[ServerMetrics] = None) -> FastAPI:
    """The FastAPI app over a started EngineClient. ``metrics`` defaults to a new ServerMetrics."""
    metrics = metrics or client.metrics or ServerMetrics(settings.model_name)
    app = FastAPI(title="Idleless", version="0.1.0",
                  description="OpenAI-compatible LLM server (see idleless.server.app)")
    app.state.client = client
    app.state.settings = settings
    app.state.metrics = metrics
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, metrics=metrics)
    _add_error_handlers(app, metrics)
    ctx = ServerContext(client, settings, metrics)
    for routes in (routes_openai, routes_native, routes_admin, routes_rl):
        routes.register(app, ctx)
    return app
