"""Admin routes: GET /health, GET /metrics, GET /server_info, POST /flush_cache, POST /pin_prefix,
POST /unpin_prefix. All but /health sit behind ``--api-key`` like every other route."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from idleless.engine.messages import GetStats
from idleless.engine.request import RequestError
from idleless.server.context import ServerContext, engine_unavailable
from idleless.server.engine_client import CallRefused, EngineDeadError
from idleless.server.protocol import APIError, PinPrefixRequest, UnpinPrefixRequest, error_body, parse_request
from idleless.telemetry.metrics import CONTENT_TYPE_LATEST


def register(app: FastAPI, ctx: ServerContext) -> None:
    """Add the admin routes to ``app``."""
    client, settings, metrics = ctx.client, ctx.settings, ctx.metrics

    def cache_disabled() -> APIError:
        return APIError(400, "the prefix cache is disabled (--disable-radix-cache): nothing can be pinned",
                        code="prefix_cache_disabled")

    @app.get("/health")
    async def health():
        if await client.healthy():
            return Response(status_code=200)
        return JSONResponse(error_body("the engine core is not answering", "service_unavailable_error", None,
                                       "engine_unavailable"), status_code=503)

    @app.get("/metrics")
    async def metrics_route():
        stats, ok = None, False
        if not client.dead:
            try:
                stats = await client.call(GetStats(), timeout=5.0)
                ok = True
            except Exception:  # noqa: BLE001 - still export the frontend's metrics
                pass
        metrics.update_core(stats, ok)
        metrics.set_inflight(client.num_inflight)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache():
        try:
            ok = await client.flush_cache(timeout=30.0)
        except EngineDeadError as e:
            raise engine_unavailable(e) from None
        if not ok:
            raise APIError(400, "cannot flush the cache while requests are running", code="requests_running")
        return JSONResponse({"success": True, "message": "cache flushed"})

    @app.post("/pin_prefix")
    async def pin_prefix(request: Request):
        """``{"text": "..."} | {"input_ids": [...]}, "ttl_s": 600, "pin_id": optional}`` ->
        ``{"success": true, "pin_id", "num_tokens", "ttl_s"}``: the prefix (cut to whole KV pages) stays
        cached until the TTL runs out or it is unpinned, and counts against every request's KV limit.
        400 for bad input, the prefix cache disabled, or the pinned budget (--max-pinned-tokens) exceeded."""
        req = parse_request(PinPrefixRequest, await ctx.read_json(request))
        if (req.input_ids is None) == (req.text is None):
            raise APIError(400, "give exactly one of input_ids and text", param="input_ids", code="invalid_value")
        if client.config.disable_radix_cache:
            raise cache_disabled()
        param = "input_ids" if req.input_ids is not None else "text"
        ids = list(req.input_ids) if req.input_ids is not None else await ctx.encode(req.text, "text")
        try:
            pin_id, tokens = await client.pin_prefix(ids, req.ttl_s, req.pin_id)
        except RequestError as e:
            p = param if e.param in ("prompt", "max_tokens") else e.param
            raise APIError(400, e.message, param=p, code=e.code) from None
        except CallRefused as e:
            raise APIError(400, str(e), param=param, code="pin_refused") from None
        except EngineDeadError as e:
            raise engine_unavailable(e) from None
        return JSONResponse({"success": True, "pin_id": pin_id, "num_tokens": tokens, "ttl_s": req.ttl_s})

    @app.post("/unpin_prefix")
    async def unpin_prefix(request: Request):
        """``{"pin_id": "..."}`` -> ``{"success": true, "pin_id"}``; 404 (code ``pin_not_found``) when
        no such pin is held (never made, expired, or flushed); 400 when the prefix cache is disabled."""
        req = parse_request(UnpinPrefixRequest, await ctx.read_json(request))
        if client.config.disable_radix_cache:
            raise cache_disabled()
        try:
            found = await client.unpin_prefix(req.pin_id)
        except EngineDeadError as e:
            raise engine_unavailable(e) from None
        if not found:
            raise APIError(404, f"no pin with id {req.pin_id!r} (never made, expired, or flushed)",
                           param="pin_id", code="pin_not_found")
        return JSONResponse({"success": True, "pin_id": req.pin_id})

    @app.get("/server_info")
    async def server_info():
        info = client.info
        try:
            stats = await client.call(GetStats(), timeout=5.0)
        except Exception:  # noqa: BLE001
            stats = None
        return JSONResponse({
            "model": settings.model_name, "model_path": settings.model_path, "dtype": info.dtype,
            "context_length": info.context_length, "kv_slots": info.kv_slots, "vocab_size": info.vocab_size,
            "max_running_requests": info.max_running_requests, "max_inflight": client.max_inflight,
            "num_inflight": client.num_inflight, "engine_pid": info.pid, "load_seconds": info.load_seconds,
            "system_fingerprint": settings.system_fingerprint, "stats": stats, **settings.extra_info})
