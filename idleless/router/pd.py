"""``idleless router --pd-disaggregation --prefill URL... --decode URL...``: the PD router (SGLang's flags).

Per request (vLLM's disaggregated-serving flow, over the engines' OpenAI routes):
1. a prefill engine, picked by ``--policy`` over the prefill workers (``exact`` by default: the one
   holding the longest prefix), gets the request with ``max_tokens: 1``, ``stream: false``, ``n: 1`` and
   ``kv_transfer_params: {"do_remote_decode": true}``; it prefills (with its own radix cache) and answers
   with ``kv_transfer_params`` saying where its KV can be pulled;
2. a decode engine, picked by ``--decode-policy`` over the decode workers (``power_of_two`` by
   default: by load), gets the original request plus those ``kv_transfer_params``; it pulls the KV of
   the prompt's tokens it does not already cache (``idleless.disagg.decode``) and decodes; its answer,
   streamed or whole, is the client's.
Every failure ends: a prefill leg that fails (refused, 5xx, no answer within
``--prefill-timeout-secs``, an engine not in prefill mode) sends the request to the decode leg without
``kv_transfer_params`` (the decode engine prefills it itself) and is counted; the decode leg retries
workers it never started on and ends a broken stream with an error event, as the plain router does.
No pair is remembered as failed: the next request picks afresh.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from typing import Optional
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from idleless.router.app import Router, _error, proxy_app, read_json_object
from idleless.router.metrics import render_metrics

log = logging.getLogger("idleless.router")

# fields the prefill leg does not need (it samples one token nobody reads)
_PREFILL_DROP = ("stream", "stream_options", "n", "best_of", "echo", "logprobs", "top_logprobs", "min_tokens",
                 "prompt_logprobs", "max_completion_tokens")


def prefill_body(body: dict) -> dict:
    """The prefill leg's request: the client's, for one token, unstreamed, asking where its KV can be pulled."""
    p = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    p.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return p


class PDRouter:
    """A prefill ``Router`` and a decode ``Router`` chained per request (module docstring).
    ``counters``: ``prefill_ok``, ``prefill_failed`` (the decode engine recomputed), ``prefill_skipped``
    (no healthy prefill worker)."""

    def __init__(self, prefill: Router, decode: Router, prefill_timeout_s: float = 60.0):
        self.prefill = prefill
        self.decode = decode
        self.prefill_timeout_s = prefill_timeout_s
        self.counters = {"prefill_ok": 0, "prefill_failed": 0, "prefill_skipped": 0}

    async def proxy(self, request: Request, path: str) -> Response:
        raw, body = await read_json_object(request)
        if body is None:
            return _error(400, "the body is not a JSON object", "invalid_json", "invalid_request_error")
        headers = self.decode._headers(request)
        params = await self._prefill_leg(body, headers, path)
        if params is not None:
            body = {**body, "kv_transfer_params": params}
            raw = json.dumps(body).encode()
        return await self.decode.forward(raw, body, headers, path)

    async def _prefill_leg(self, body: dict, headers: dict, path: str) -> Optional[dict]:
        """Run the prefill leg; the decode engine's ``kv_transfer_params``, or None (it recomputes)."""
        pbody = prefill_body(body)
        candidates = self.prefill.pool.healthy()
        if not candidates:
            self.counters["prefill_skipped"] += 1
            return None
        inp = await self.prefill.route_input(pbody)
        w, cached = self.prefill.policy.select(candidates, inp)
        key = next(self.prefill._keys)
        w.begin(key, inp.tokens, cached)
        try:
            # No _until_dead here: an unstreamed prefill sends nothing until it is done, so a busy prefill
            # engine looks lifeless to the health loop; a dead one breaks the connection, and
            # --prefill-timeout-secs bounds the rest.
            resp = await self.prefill.pool.client.post(w.url + path, json=pbody, headers=headers,
                                                       timeout=self.prefill_timeout_s)
            w.last_progress = time.monotonic()  # an answer is a sign of life
            out = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as e:
            w.errors += 1
            log.warning("prefill leg on %s failed (%s): the decode engine prefills", w.url, type(e).__name__)
            self.counters["prefill_failed"] += 1
            return None
        finally:
            w.finish(key)
        params = out.get("kv_transfer_params") if isinstance(out, dict) else None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            why = f"HTTP {resp.status_code}" if out is None else "no kv_transfer_params (not in prefill mode?)"
            log.warning("prefill leg on %s: %s; the decode engine prefills", w.url, why)
            self.counters["prefill_failed"] += 1
            return None
        if not params.get("remote_host"):
            params = {**params, "remote_host": urlsplit(w.url).hostname}
        self.counters["prefill_ok"] += 1
        return params

    async def close(self) -> None:
        for r in (self.prefill, self.decode):
            await r.pool.stop()
            await r.pool.client.aclose()


def build_pd_app(pd: PDRouter) -> FastAPI:
    """The PD router's app: the OpenAI routes through both legs, /health (a decode worker suffices),
    /workers and /metrics over both pools, ``--api-key`` as the plain router."""
    app = proxy_app("idleless PD router", pd.decode.settings.api_key, pd.proxy, pd.decode.models)

    @app.get("/health")
    async def health():
        if pd.decode.pool.healthy():
            return Response(status_code=200)
        return _error(503, "no healthy decode worker", "no_healthy_workers")

    @app.get("/workers")
    async def workers():
        return JSONResponse({
            "prefill": {"policy": pd.prefill.policy.name, "workers": [w.describe() for w in pd.prefill.pool.workers.values()]},
            "decode": {"policy": pd.decode.policy.name, "workers": [w.describe() for w in pd.decode.pool.workers.values()]},
            "counters": pd.counters})

    @app.get("/metrics")
    async def metrics():
        ws = list(pd.prefill.pool.workers.values()) + list(pd.decode.pool.workers.values())
        body, ctype = render_metrics(ws, f"pd:{pd.prefill.policy.name}/{pd.decode.policy.name}")
        return Response(body, media_type=ctype)

    return app


async def build_pd_router(args) -> PDRouter:
    """Both legs' Routers from the router's flags: ``--prefill`` URLs with ``--policy``, ``--decode``
    URLs with ``--decode-policy``. Raises ValueError when either list is empty."""
    from idleless.router.launch import build_router
    if not args.prefill or not args.decode:
        raise ValueError("--pd-disaggregation needs --prefill URL... and --decode URL...")
    pa = copy.copy(args)
    pa.worker_urls = list(args.prefill)
    da = copy.copy(args)
    da.worker_urls, da.policy = list(args.decode), args.decode_policy
    prefill, decode = await asyncio.gather(build_router(pa), build_router(da))
    return PDRouter(prefill, decode, args.prefill_timeout_secs)
