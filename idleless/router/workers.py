"""The router's workers: one ``Worker`` per engine URL (health, load, what it caches, counters) and
the ``WorkerPool`` that checks them.

Health: ``GET /health`` every ``health_interval_s``; ``failure_threshold`` failures in a row mark a
worker unhealthy (no new traffic); one success marks it healthy again (a restarted worker rejoins).
A worker is *dead* — its ``dead`` event set, so requests in flight there end at once with an error —
when it is unhealthy and either refuses connections (the process is gone) or has shown no sign of
life (a byte of an answer, a KV-event heartbeat) for ``dead_after_s``. A check that times out or
gets a 503 while the worker still shows signs of life (within ``health_timeout_s``) is no failure:
the engine core answers /health only between steps, a long prefill step on a loaded machine
outlasts the timeout, and ending its streams would turn load into errors. When a
worker is healthy the pool reads its ``GET /get_server_info``: a ``kv_events_config`` there starts a
``KVEventSubscriber`` on its endpoints (the exact policy's index and load reports); without one, its
load comes from ``GET /v1/loads``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Optional
from urllib.parse import urlsplit

import httpx

from idleless.router.events import KVEventsConfig, connect_address
from idleless.router.subscriber import KVEventSubscriber

log = logging.getLogger("idleless.router")

LOAD_FRESH_S = 10.0  # an engine load report older than this is ignored
RECENT_PROMPT_S = 2.0  # a finished prompt counts as cached until its KV events have had time to arrive


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Worker:
    """One engine replica as the router sees it. Counters (``routed``, ``predicted_hit_tokens``,
    ``prompt_tokens``, ``cached_tokens`` as the engine reported in ``usage``, ``errors``,
    ``retries``) feed /metrics. ``requests`` holds the router's requests in flight here (routed at,
    uncached prompt tokens until the first byte is back, prompt ids); ``engine_load`` is the engine's
    last load report when it has no KV-event stream (from /v1/loads)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.healthy = False  # until its first check passes
        self.failures = 0
        self.dead = asyncio.Event()
        self.last_progress = 0.0  # time.monotonic() of the last byte received from it
        self.requests: dict[int, list] = {}  # key -> [routed at (Unix s), uncached tokens, prompt ids]
        self.engine_load: Optional[dict] = None
        self.subscriber: Optional[KVEventSubscriber] = None
        self.recent: deque = deque(maxlen=256)  # (finished at, prompt token ids)
        self.routed = self.predicted_hit_tokens = self.prompt_tokens = self.cached_tokens = 0
        self.errors = self.retries = 0

    @property
    def host(self) -> str:
        """The worker URL's host name (where its KV-event endpoints are reached)."""
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def inflight(self) -> int:
        """The router's requests in flight on this worker."""
        return len(self.requests)

    def alive_at(self) -> float:
        """time.monotonic() of the last sign of life: a byte of an answer or a KV-event message."""
        sub = self.subscriber
        return max(self.last_progress, sub.last_message if sub is not None else 0.0)

    def report(self) -> Optional[dict]:
        """The engine's last load report (KV-event stream, else /v1/loads) if fresh, else None."""
        if self.subscriber is not None and self.subscriber.stream.load is not None:
            rep = self.subscriber.stream.load
        else:
            rep = self.engine_load
        if rep is None or time.time() - rep.get("timestamp", 0) > LOAD_FRESH_S:
            return None
        return rep

    def _since(self, rep: Optional[dict]) -> list[list]:
        """The router's requests the report cannot know of yet (routed after it), all without one."""
        if rep is None:
            return list(self.requests.values())
        return [r for r in self.requests.values() if r[0] > rep["timestamp"]]

    def load(self) -> int:
        """Requests in flight: the engine's running + waiting (other routers' requests included) plus
        the ones routed here since that report; the router's own count without a report."""
        rep = self.report()
        base = rep["num_running"] + rep["num_waiting"] if rep else 0
        return base + len(self._since(rep))

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens waiting to be prefilled, as ``load`` counts requests."""
        rep = self.report()
        base = int(rep.get("queued_prefill_tokens", 0)) if rep else 0
        return base + sum(r[1] for r in self._since(rep))

    def cached_prefix(self, tokens: list[int]) -> int:
        """The longest prefix of ``tokens`` this worker holds (its KV-event index when synced) or will
        hold (a prompt routed here that is in flight or just finished), in tokens."""
        best = 0
        sub = self.subscriber
        if sub is not None and sub.synced:
            best = sub.stream.index.match(tokens)
        now = time.monotonic()
        while self.recent and now - self.recent[0][0] > RECENT_PROMPT_S:
            self.recent.popleft()
        for p in [r[2] for r in self.requests.values()] + [p for _, p in self.recent]:
            if p and len(p) > best:
                best = max(best, _common_prefix(p, tokens))
        return best

    def begin(self, key: int, tokens: Optional[list[int]], cached: int) -> None:
        """A request (prompt ``tokens``, None when not tokenized; ``cached`` of them predicted to hit)
        was routed here: held as in flight under ``key`` and counted (routed, prompt, predicted hit)."""
        n = len(tokens) if tokens else 0
        self.requests[key] = [time.time(), max(0, n - cached), tokens]
        self.routed += 1
        self.prompt_tokens += n
        self.predicted_hit_tokens += cached

    def started(self, key: int) -> None:
        """Its first byte came back: its prompt is prefilled."""
        if key in self.requests:
            self.requests[key][1] = 0

    def finish(self, key: int) -> None:
        """The request ended (any way); its prompt counts as just cached for a moment."""
        r = self.requests.pop(key, None)
        if r is not None and r[2]:
            self.recent.append((time.monotonic(), r[2]))

    def mark(self, healthy: bool, dead: bool = False) -> None:
        """Healthy again, or unhealthy (no new traffic) and, with ``dead``, its requests ended."""
        if healthy:
            self.failures = 0
            if not self.healthy:
                log.info("worker %s is healthy again", self.url)
            self.healthy = True
            self.dead = asyncio.Event() if self.dead.is_set() else self.dead
        else:
            if self.healthy:
                log.warning("worker %s is unhealthy", self.url)
            self.healthy = False
            if dead:
                self.dead.set()

    def describe(self) -> dict:
        """The worker's state as JSON (``GET /workers``)."""
        sub = self.subscriber
        return {"url": self.url, "healthy": self.healthy, "inflight": self.inflight, "load": self.load(),
                "queued_prefill_tokens": self.queued_prefill_tokens(), "routed": self.routed,
                "kv_events": None if sub is None else {"endpoint": sub.endpoint, "synced": sub.synced,
                                                       "seq": sub.stream.seq, "snapshots": sub.stream.snapshots,
                                                       "index_tokens": sub.stream.index.num_tokens},
                "engine_load": self.report()}


class WorkerPool:
    """The workers in order of addition, with the health loop. ``headers``: sent on the router's own
    calls to workers (a worker API key)."""

    def __init__(self, client: httpx.AsyncClient, health_interval_s: float = 5.0, health_timeout_s: float = 10.0,
                 failure_threshold: int = 3, headers: Optional[dict] = None, use_kv_events: bool = True,
                 dead_after_s: float = 60.0):
        self.client = client
        self.workers: dict[str, Worker] = {}
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.failure_threshold = failure_threshold
        self.dead_after_s = dead_after_s
        self.headers = headers or {}
        self.use_kv_events = use_kv_events
        self._task: Optional[asyncio.Task] = None

    def healthy(self) -> list[Worker]:
        """The workers that pass their health checks, in order of addition."""
        return [w for w in self.workers.values() if w.healthy]

    async def add(self, url: str) -> Worker:
        """Add (or return) the worker at ``url`` and check it now."""
        url = url.rstrip("/")
        w = self.workers.get(url)
        if w is None:
            w = self.workers[url] = Worker(url)
            await self.check(w)
        return w

    async def remove(self, url: str) -> Optional[Worker]:
        """Take the worker at ``url`` out (its requests in flight end); None if unknown."""
        w = self.workers.pop(url.rstrip("/"), None)
        if w is not None:
            w.mark(False, dead=True)
            if w.subscriber is not None:
                await w.subscriber.stop()
        return w

    async def check(self, w: Worker) -> bool:
        """One health check (and, when healthy, the KV-event / load discovery)."""
        t0 = time.monotonic()
        down = False  # the connection failed: nothing listens there any more
        try:
            r = await self.client.get(w.url + "/health", timeout=self.health_timeout_s)
            ok = r.status_code == 200
        except httpx.TimeoutException:
            ok = False
        except httpx.HTTPError:
            ok, down = False, True
        if ok:
            w.mark(True)
            await self._discover(w)
            return True
        if not down and w.alive_at() > t0 - self.health_timeout_s:
            return False  # slow to answer, but streaming or beating: busy, not failing
        w.failures += 1
        if w.failures >= self.failure_threshold or not w.healthy:
            w.mark(False, dead=down or time.monotonic() - w.alive_at() > self.dead_after_s)
        return False

    async def _discover(self, w: Worker) -> None:
        try:
            if self.use_kv_events and (w.subscriber is None or not w.subscriber.synced):
                r = await self.client.get(w.url + "/get_server_info", headers=self.headers,
                                          timeout=self.health_timeout_s)
                text = r.json().get("kv_events_config") if r.status_code == 200 else None
                if text:
                    cfg = KVEventsConfig.parse(text)
                    ep, rep = connect_address(cfg.endpoint, w.host), connect_address(cfg.replay_endpoint, w.host)
                    if w.subscriber is None or (w.subscriber.endpoint, w.subscriber.replay_endpoint) != (ep, rep):
                        if w.subscriber is not None:
                            await w.subscriber.stop()
                        w.subscriber = KVEventSubscriber(ep, rep, cfg.topic)
                        w.subscriber.start()
            if w.subscriber is None:
                r = await self.client.get(w.url + "/v1/loads", headers=self.headers, timeout=self.health_timeout_s)
                if r.status_code == 200:
                    e = r.json()["loads"][0]
                    w.engine_load = {"num_running": e["num_running_reqs"], "num_waiting": e["num_waiting_reqs"],
                                     "kv_usage": e.get("token_usage", 0.0), "timestamp": e.get("timestamp", 0)}
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, json.JSONDecodeError) as e:
            log.debug("worker %s: discovery failed: %s", w.url, e)

    def start(self) -> None:
        """Start the health loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

    async def stop(self) -> None:
        """Stop the health loop and every KV-event subscriber."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for w in list(self.workers.values()):
            if w.subscriber is not None:
                await w.subscriber.stop()
