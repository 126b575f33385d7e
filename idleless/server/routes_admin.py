"""Admin routes: GET /health, GET /metrics, GET /server_info, POST /flush_cache, POST /pin_prefix,
POST /unpin_prefix, and SGLang's GET /v1/loads, GET /get_model_info (also /model_info) and
GET /get_server_info in SGLang's shapes. All but /health sit behind ``--api-key`` like every other
route."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from datetime import datetime, timezone

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from idleless.engine.messages import GetStats, GetWeightVersion
from idleless.engine.request import RequestError
from idleless.server.context import ServerContext, engine_unavailable
from idleless.server.engine_client import CallRefused, EngineDeadError
from idleless.server.protocol import APIError, PinPrefixRequest, UnpinPrefixRequest, error_body, parse_request
from idleless.telemetry.metrics import CONTENT_TYPE_LATEST, kv_cache_usage, kv_used_tokens


class TokenRate:
    """Tokens per second between successive reads of a running total (SGLang's ``gen_throughput``:
    the engine's generated tokens since the previous /v1/loads answer, the first since start-up)."""

    def __init__(self):
        self.at, self.total = time.monotonic(), 0

    def read(self, total: int) -> float:
        now = time.monotonic()
        rate = (total - self.total) / (now - self.at) if now > self.at else 0.0
        self.at, self.total = now, total
        return rate


def sglang_load(stats: dict, max_running_requests: int, gen_throughput: float) -> dict:
    """One engine's entry of SGLang's /v1/loads ``loads`` list from ``EngineCore.stats()``: running and
    waiting requests, KV tokens in use (``kv_used_tokens``: the radix cache's evictable tokens count as
    free once the core reports them) out of ``max_total_num_tokens``, ``token_usage`` = their ratio,
    ``gen_throughput`` (tokens/s), ``cache_hit_rate`` over the last admitted requests (the engine's
    window). SGLang's ``num_total_tokens`` (used + waiting prompt tokens) and ``utilization`` are left
    out: the engine does not report the waiting queue's tokens."""
    kv = stats["kv"]
    running, waiting = stats["num_running"], stats["num_waiting"]
    return {"dp_rank": 0, "timestamp": time.time(), "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting, "num_used_tokens": kv_used_tokens(kv),
            "max_total_num_tokens": kv["total"], "token_usage": round(kv_cache_usage(kv), 4),
            "gen_throughput": round(gen_throughput, 2), "cache_hit_rate": round(stats.get("window_hit_rate", 0.0), 4),
            "max_running_requests": max_running_requests}


def sglang_aggregate(loads: list[dict]) -> dict:
    """SGLang's /v1/loads ``aggregate`` over the ``loads`` entries (sums; means of the ratios)."""
    n = len(loads) or 1
    return {"total_running_reqs": sum(d["num_running_reqs"] for d in loads),
            "total_waiting_reqs": sum(d["num_waiting_reqs"] for d in loads),
            "total_reqs": sum(d["num_total_reqs"] for d in loads),
            "total_used_tokens": sum(d["num_used_tokens"] for d in loads),
            "avg_token_usage": round(sum(d["token_usage"] for d in loads) / n, 4),
            "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / n, 2)}


def register(app: FastAPI, ctx: ServerContext) -> None:
    """Add the admin routes to ``app``."""
    from idleless.model.loader import load_model_config  # torch: the frontend has it loaded by now

    client, settings, metrics = ctx.client, ctx.settings, ctx.metrics
    model_config = load_model_config(client.info.model_dir)
    gen_rate = TokenRate()
    metrics.set_precision(client.info.precision)

    async def engine_stats() -> dict:
        """EngineCore.stats() now; APIError 503 when the engine core is gone or does not answer."""
        try:
            return await client.call(GetStats(), timeout=5.0)
        except EngineDeadError as e:
            raise engine_unavailable(e) from None
        except asyncio.TimeoutError:
            raise APIError(503, "the engine core did not answer within 5 s", code="engine_unavailable",
                           headers={"Retry-After": "5"}) from None

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
        try:
            version = await client.call(GetWeightVersion(), timeout=5.0)
        except Exception:  # noqa: BLE001
            version = None
        return JSONResponse({
            "model": settings.model_name, "model_path": settings.model_path, "dtype": info.dtype,
            "context_length": info.context_length, "kv_slots": info.kv_slots, "vocab_size": info.vocab_size,
            "max_running_requests": info.max_running_requests, "max_inflight": client.max_inflight,
            "num_inflight": client.num_inflight, "engine_pid": info.pid, "load_seconds": info.load_seconds,
            "system_fingerprint": settings.system_fingerprint, "stats": stats,
            "speculative_algorithm": ((stats or {}).get("speculative") or {}).get("algorithm"),
            "precision": info.precision, "deterministic_inference": info.deterministic,
            "weight_version": version, **settings.extra_info})

    @app.get("/v1/loads")
    async def loads():
        """SGLang's load report: ``{"timestamp", "version", "dp_rank_count": 1, "loads": [sglang_load],
        "aggregate": sglang_aggregate}``; 503 when the engine core does not answer."""
        stats = await engine_stats()
        entry = sglang_load(stats, client.info.max_running_requests, gen_rate.read(stats["generation_tokens"]))
        return JSONResponse({"timestamp": datetime.now(timezone.utc).isoformat(), "version": app.version,
                             "dp_rank_count": 1, "loads": [entry], "aggregate": sglang_aggregate([entry])})

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        """SGLang's model info: ``model_path``, ``tokenizer_path``, ``is_generation`` (always true),
        ``preferred_sampling_params`` (none), ``weight_version`` (the served weights' label: "default"
        until an update names one; null when the engine core does not answer), ``has_image_understanding`` / ``has_audio_understanding`` (false),
        ``model_type``, ``architectures`` (from the model's config.json)."""
        try:
            version = await client.call(GetWeightVersion(), timeout=5.0)
        except Exception:  # noqa: BLE001 - an engine that does not answer: the rest is still known
            version = None
        return JSONResponse({
            "model_path": settings.model_path, "tokenizer_path": client.config.tokenizer or settings.model_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": version,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": model_config.model_type, "architectures": [model_config.architecture]})

    @app.get("/get_server_info")
    async def get_server_info():
        """SGLang's server info: the server args (every EngineConfig field, also under SGLang's names
        ``model_path``, ``tokenizer_path``, ``random_seed``, with ``tp_size`` / ``dp_size`` 1, host and
        port; never the API key; ``dtype`` and ``enable_deterministic_inference`` as the engine resolved
        them), the scheduler info (``max_total_num_tokens``, ``max_req_input_len``),
        ``internal_states`` (the engine's stats, one entry per engine; empty when it does not answer)
        and ``version``."""
        try:
            states = [await engine_stats()]
        except APIError:
            states = []
        cfg = client.config
        return JSONResponse({
            **dataclasses.asdict(cfg), "dtype": client.info.dtype,  # as resolved, like the next one
            "enable_deterministic_inference": client.info.deterministic,
            "model_path": settings.model_path,
            "tokenizer_path": cfg.tokenizer or settings.model_path, "random_seed": cfg.seed,
            "tp_size": cfg.tensor_parallel_size,
            "dp_size": 1, **settings.extra_info, "max_total_num_tokens": client.info.kv_slots,
            "max_req_input_len": client.limit_tokens, "internal_states": states, "version": app.version})
