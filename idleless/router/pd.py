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
A ``transfer_id`` of the router's goes with both legs: the prefill engine times the request under it
and sends its queue and prefill seconds with the KV, so the decode engine holds each request's TTFT
split (``idleless.disagg.timing``). The router's /metrics shows its own per-request times (the
prefill leg, the time to the decode engine's first token) and, read from the decode engines'
``/server_info`` when /metrics is scraped, their split histograms.
Every failure ends: a prefill leg that fails (refused, 5xx, no answer within
``--prefill-timeout-secs``, an engine not in prefill mode) sends the request to the decode leg without
``kv_transfer_params`` (the decode engine prefills it itself) and is counted; the decode leg retries
workers it never started on and ends a broken stream with an error event, as the plain router does.
No pair is remembered as failed: the next request picks afresh.

With ``--pd-layerwise`` the router does not wait for the prefill leg: it sends both legs at once, the
decode leg's ``kv_transfer_params`` naming the prefill engine's transfer address (read once per
prefill engine from its ``/server_info``) with ``"layerwise": true``, and the decode engine receives
the KV layer by layer while the prefill engine computes it (``idleless.disagg.layerwise``). A
prefill leg that fails then ends the decode engine's pull with an error reply or its
``--disaggregation-timeout``, after which it recomputes (``--pd-fallback``); a prefill engine whose
address cannot be read gets the sequential legs above.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from typing import Optional
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

from idleless.disagg import timing
from idleless.disagg.http import WILDCARD_HOSTS
from idleless.router.app import Router, _error, proxy_app, read_json_object
from idleless.router.metrics import render_metrics

log = logging.getLogger("idleless.router")

# fields the prefill leg does not need (it samples one token nobody reads)
_PREFILL_DROP = ("stream", "stream_options", "n", "best_of", "echo", "logprobs", "top_logprobs", "min_tokens",
                 "prompt_logprobs", "max_completion_tokens")


def prefill_body(body: dict, transfer_id: str) -> dict:
    """The prefill leg's request: the client's, for one token, unstreamed, asking where its KV can be
    pulled (the prefill engine times it under ``transfer_id``)."""
    p = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    p.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
    return p


class _SplitCollector:
    """The decode engines' TTFT split histograms (``timing.SplitStats`` snapshots), one series per
    engine (label ``worker``), as last read by ``PDRouter.read_splits``."""

    def __init__(self):
        self.snapshots: dict[str, dict] = {}

    def collect(self):
        for part in timing.PARTS:
            fam = HistogramMetricFamily(f"idleless_router_pd_ttft_{part}_seconds",
                                        f"the {part.replace('_', ' ')} part of disaggregated requests' time to first "
                                        "token, as the decode engine recorded it", labels=["worker"])
            for url, snap in self.snapshots.items():
                buckets = [(repr(float(b)), c) for b, c in zip(snap["buckets"], snap["counts"][part])]
                buckets.append(("+Inf", snap["observed"][part]))
                fam.add_metric([url], buckets, snap["sums"][part])
            yield fam


class PDRouter:
    """A prefill ``Router`` and a decode ``Router`` chained per request (module docstring).
    ``counters``: ``prefill_ok``, ``prefill_failed`` (the decode engine recomputed), ``prefill_skipped``
    (no healthy prefill worker). ``registry``: the router's own histograms, ``splits``: the decode
    engines' (module docstring)."""

    def __init__(self, prefill: Router, decode: Router, prefill_timeout_s: float = 60.0, layerwise: bool = False):
        self.prefill = prefill
        self.decode = decode
        self.prefill_timeout_s = prefill_timeout_s
        self.layerwise = layerwise
        self._bootstrap: dict[str, tuple[str, int]] = {}  # prefill URL -> its transfer host and port
        self._legs: set[asyncio.Task] = set()  # prefill legs running beside their decode legs
        self.counters = {"prefill_ok": 0, "prefill_failed": 0, "prefill_skipped": 0}
        self.registry = CollectorRegistry()
        self.prefill_leg = Histogram("idleless_router_pd_prefill_leg_seconds", "from sending the prefill leg to "
                                     "its answer (successful legs)", buckets=timing.BUCKETS, registry=self.registry)
        self.ttft = Histogram("idleless_router_pd_ttft_seconds", "streamed requests: from the router's receipt to "
                              "the decode engine's response head (sent with its first token)",
                              buckets=timing.BUCKETS, registry=self.registry)
        self.splits = _SplitCollector()
        self.registry.register(self.splits)

    async def proxy(self, request: Request, path: str) -> Response:
        t0 = time.perf_counter()
        raw, body = await read_json_object(request)
        if body is None:
            return _error(400, "the body is not a JSON object", "invalid_json", "invalid_request_error")
        headers = self.decode._headers(request)
        params = await (self._start_prefill_leg if self.layerwise else self._prefill_leg)(body, headers, path)
        if params is not None:
            body = {**body, "kv_transfer_params": params}
            raw = json.dumps(body).encode()
        resp = await self.decode.forward(raw, body, headers, path)
        if resp.status_code == 200 and resp.media_type == "text/event-stream":
            self.ttft.observe(time.perf_counter() - t0)
        return resp

    async def read_splits(self) -> None:
        """Read each healthy decode engine's TTFT split histograms from its ``/server_info`` (engines
        that do not answer keep their last reading)."""
        async def one(w):
            try:
                r = await self.decode.pool.client.get(w.url + "/server_info", timeout=5.0)
                split = ((r.json().get("stats") or {}).get("kv_transfer") or {}).get("ttft_split")
            except (httpx.HTTPError, ValueError, AttributeError):
                return
            if isinstance(split, dict) and split.get("buckets") == list(timing.BUCKETS):
                self.splits.snapshots[w.url] = split
        await asyncio.gather(*(one(w) for w in self.decode.pool.healthy()))

    async def _pick_prefill(self, pbody: dict):
        """The prefill worker for ``pbody`` (by ``--policy``), begun; None when none is healthy."""
        candidates = self.prefill.pool.healthy()
        if not candidates:
            self.counters["prefill_skipped"] += 1
            return None
        inp = await self.prefill.route_input(pbody)
        w, cached = self.prefill.policy.select(candidates, inp)
        key = next(self.prefill._keys)
        w.begin(key, inp.tokens, cached)
        return w, key

    async def _prefill_leg(self, body: dict, headers: dict, path: str) -> Optional[dict]:
        """Run the prefill leg; the decode engine's ``kv_transfer_params``, or None (it recomputes)."""
        pbody = prefill_body(body, uuid.uuid4().hex)
        picked = await self._pick_prefill(pbody)
        if picked is None:
            return None
        return await self._run_prefill_leg(*picked, pbody, headers, path)

    async def _start_prefill_leg(self, body: dict, headers: dict, path: str) -> Optional[dict]:
        """``--pd-layerwise``: start the prefill leg and return the decode engine's layer-wise
        ``kv_transfer_params`` at once (the sequential legs when the prefill engine's transfer address
        cannot be read; None when no prefill worker is healthy)."""
        tid = uuid.uuid4().hex
        pbody = prefill_body(body, tid)
        picked = await self._pick_prefill(pbody)
        if picked is None:
            return None
        w, key = picked
        addr = await self._transfer_address(w.url)
        if addr is None:
            return await self._run_prefill_leg(w, key, pbody, headers, path)
        task = asyncio.create_task(self._run_prefill_leg(w, key, pbody, headers, path))
        self._legs.add(task)
        task.add_done_callback(self._legs.discard)
        return {"do_remote_prefill": True, "remote_host": addr[0], "remote_port": addr[1], "transfer_id": tid,
                "layerwise": True}

    async def _transfer_address(self, url: str) -> Optional[tuple[str, int]]:
        """The prefill engine's KV transfer host and port, from its ``/server_info`` (kept per URL until
        a leg to it fails); None when it does not say (not in prefill mode, unreachable)."""
        if url in self._bootstrap:
            return self._bootstrap[url]
        try:
            r = await self.prefill.pool.client.get(url + "/server_info", timeout=5.0)
            kv = (r.json().get("stats") or {}).get("kv_transfer") or {}
            host, port = urlsplit(kv["address"]).hostname, urlsplit(kv["address"]).port
        except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError):
            return None
        if kv.get("mode") != "prefill" or not port:
            return None
        if host in WILDCARD_HOSTS:
            host = urlsplit(url).hostname
        self._bootstrap[url] = (host, port)
        return host, port

    async def _run_prefill_leg(self, w, key, pbody: dict, headers: dict, path: str) -> Optional[dict]:
        """Send the prefill leg to worker ``w`` (begun under ``key``); its ``kv_transfer_params`` or None."""
        t_sent = time.monotonic()
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
            self._bootstrap.pop(w.url, None)
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
        self.prefill_leg.observe(time.monotonic() - t_sent)
        return params

    async def close(self) -> None:
        for t in list(self._legs):
            t.cancel()
        for r in (self.prefill, self.decode):
            await r.pool.stop()
            await r.pool.client.aclose()


def build_pd_app(pd: PDRouter) -> FastAPI:
    """The PD router's app: the OpenAI routes through both legs, /health (a decode worker suffices),
    /workers and /metrics over both pools (and the PD histograms), ``--api-key`` as the plain router."""
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
        await pd.read_splits()
        return Response(body + generate_latest(pd.registry), media_type=ctype)

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
    return PDRouter(prefill, decode, args.prefill_timeout_secs, getattr(args, "pd_layerwise", False))
