"""The router's proxy (idleless/router/app.py) against fake workers: small FastAPI apps served by
uvicorn on free ports in the test's event loop (no model). Streaming passes through byte for byte; a
request whose worker refuses the connection or answers 503 is retried on another; a stream whose
worker breaks or is declared dead ends with an SSE error event and [DONE]; the API key's 401 has
the OpenAI error shape; workers come and go through /add_worker and /remove_worker; /metrics counts
per worker; the exact policy follows a worker's real KV-event publisher."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from conftest_router import free_port
from idleless.router.app import Router, RouterSettings, build_app
from idleless.router.launch import add_args, build_router
from idleless.router.policies import Exact
from idleless.router.prompts import PromptTokenizer
from idleless.router.workers import WorkerPool

pytestmark = pytest.mark.timeout(120)

CHUNKS = [b'data: {"choices":[{"text":"he"}]}\n\n', b'data: {"choices":[{"text":"llo"}]}\n\n',
          b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":7}}}\n\n', b"data: [DONE]\n\n"]


def fake_worker(name: str, mode: dict) -> FastAPI:
    """mode["stream"]: "ok" | "break" (the connection drops after one chunk) | "hang" (one chunk, then
    nothing); mode["status"]: the status of completions (503: draining); mode["server_info"]: extra
    /get_server_info fields."""
    app = FastAPI()
    app.state.hits = 0

    @app.get("/health")
    async def health():
        await asyncio.sleep(mode.get("health_delay", 0))
        return Response(status_code=mode.get("health", 200))

    @app.get("/get_server_info")
    async def info():
        return JSONResponse(mode.get("server_info", {}))

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{"id": name}]})

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.hits += 1
        if mode.get("status", 200) != 200:
            return JSONResponse({"error": {"message": "draining"}}, status_code=mode["status"])
        if not body.get("stream"):
            return JSONResponse({"worker": name, "usage": {"prompt_tokens_details": {"cached_tokens": 3}}})

        async def gen():
            yield CHUNKS[0]
            kind = mode.get("stream", "ok")
            if kind == "break":
                raise RuntimeError("worker crashed")
            if kind == "hang":
                await asyncio.sleep(3600)
            await asyncio.sleep(0.01)
            for c in CHUNKS[1:]:
                yield c

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


class Served:
    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None,
                                                    lifespan="off"))
        self.app = app

    async def __aenter__(self):
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc):
        self.server.should_exit = True
        self.server.force_exit = True
        await asyncio.wait_for(self.task, 10)


def router_args(urls, *extra):
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(["--worker-urls", *urls, "--health-check-interval-secs", "3600", *extra])


async def _router(urls, *extra):
    router = await build_router(router_args(urls, *extra))
    return router, Served(build_app(router))


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 100))


def test_stream_passes_through_and_unstarted_requests_are_retried():
    async def main():
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        async with Served(fake_worker("live", {})) as live, Served(fake_worker("busy", {"status": 503})) as busy:
            router, rsrv = await _router([dead, busy.url, live.url], "--policy", "round_robin")
            assert [w.healthy for w in router.pool.workers.values()] == [False, True, True]
            router.pool.workers[dead].mark(True)  # as if it died after its last check
            async with rsrv, httpx.AsyncClient(base_url=rsrv.url, timeout=30) as c:
                # round robin (turn 0) picks the dead worker: refused -> retried among [busy, live] at turn 1: live
                r = await c.post("/v1/completions", json={"prompt": "hi", "stream": True})
                assert r.status_code == 200 and r.content == b"".join(CHUNKS)
                assert r.headers["content-type"].startswith("text/event-stream")
                assert (busy.app.state.hits, live.app.state.hits) == (0, 1)
                assert not router.pool.workers[dead].healthy  # a refused connection marks it unhealthy
                # turn 2 among [busy, live]: busy answers 503 (not started) -> retried on live
                r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
                assert r.json()["worker"] == "live" and busy.app.state.hits == 1
                ws = (await c.get("/workers")).json()["workers"]
                assert [(w["routed"], w["inflight"]) for w in ws] == [(1, 0), (1, 0), (2, 0)]
                m = (await c.get("/metrics")).text
                assert f'idleless_router_retries_total{{worker="{dead}"}} 1.0' in m
                assert f'idleless_router_cached_tokens_total{{worker="{live.url}"}} 10.0' in m  # 7 streamed + 3
                assert f'idleless_router_healthy{{worker="{dead}"}} 0.0' in m
                # every worker down -> 503 in the OpenAI shape, no hang
                router.pool.workers[live.url].healthy = False
                router.pool.workers[busy.url].healthy = False
                r = await c.post("/v1/completions", json={"prompt": "hi"})
                assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_workers"
                assert (await c.get("/health")).status_code == 503
            await router.pool.stop()

    run(main())


@pytest.mark.parametrize("failure", ["break", "hang"])
def test_a_started_stream_ends_with_an_error_event(failure):
    async def main():
        async with Served(fake_worker("w", {"stream": failure})) as w:
            router, rsrv = await _router([w.url], "--policy", "round_robin")
            async with rsrv, httpx.AsyncClient(base_url=rsrv.url, timeout=30) as c:
                async with c.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
                    got = b""
                    async for chunk in r.aiter_raw():
                        got += chunk
                        if failure == "hang" and got == CHUNKS[0]:
                            router.pool.workers[w.url].mark(False, dead=True)  # the health check declares it dead
                events = [e for e in got.split(b"\n\n") if e]
                assert events[0] + b"\n\n" == CHUNKS[0] and events[-1] == b"data: [DONE]"
                err = json.loads(events[-2][len(b"data: "):])["error"]
                assert err["code"] == "worker_failed" and err["type"] == "server_error"
                assert router.pool.workers[w.url].errors == 1 and router.pool.workers[w.url].inflight == 0
            await router.pool.stop()

    run(main())


def test_api_key_and_worker_membership():
    async def main():
        async with Served(fake_worker("a", {})) as a, Served(fake_worker("b", {})) as b:
            router, rsrv = await _router([a.url], "--policy", "round_robin", "--api-key", "sk-r")
            async with rsrv, httpx.AsyncClient(base_url=rsrv.url, timeout=30) as c:
                r = await c.post("/v1/completions", json={"prompt": "hi"})
                assert r.status_code == 401
                assert r.json() == {"error": {"message": "missing API key (Authorization: Bearer ...)",
                                              "type": "authentication_error", "param": None,
                                              "code": "invalid_api_key"}}
                r = await c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer no"})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert (await c.get("/health")).status_code == 200  # open
                h = {"Authorization": "Bearer sk-r"}
                assert (await c.post("/add_worker", params={"url": b.url}, headers=h)).json()["healthy"] is True
                got = [(await c.post("/v1/completions", json={"prompt": "x"}, headers=h)).json()["worker"]
                       for _ in range(4)]
                assert got == ["a", "b", "a", "b"]
                assert (await c.post("/remove_worker", params={"url": a.url}, headers=h)).status_code == 200
                assert (await c.post("/remove_worker", params={"url": a.url}, headers=h)).status_code == 404
                got = [(await c.post("/v1/completions", json={"prompt": "x"}, headers=h)).json()["worker"]
                       for _ in range(2)]
                assert got == ["b", "b"]
                assert (await c.get("/v1/models", headers=h)).json()["data"][0]["id"] == "b"
            await router.pool.stop()

    run(main())


class ByteTokenizer:
    """Token ids = the UTF-8 bytes of the prompt (the chat form: role and content per message)."""

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())

    def apply_chat_template(self, messages, **kw):
        return list("".join(f"<{m['role']}>{m['content']}" for m in messages).encode())


def test_exact_follows_a_workers_kv_events():
    """Worker b's engine publishes that it holds the system prompt's tokens: a request sharing it goes
    to b although round-robin order or load alone would pick a; after b reports evicting it, the next
    same request goes to the first worker (equal loads, no prefix anywhere)."""
    from idleless.router.events import KVEventPublisher, KVEventsConfig

    pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                          heartbeat_s=0.05))
    cfg = json.dumps({"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "heartbeat_s": 0.05})

    async def main():
        async with Served(fake_worker("a", {})) as a, \
                Served(fake_worker("b", {"server_info": {"kv_events_config": cfg}})) as b:
            client = httpx.AsyncClient(timeout=30)
            pool = WorkerPool(client, health_interval_s=3600)
            await pool.add(a.url)
            await pool.add(b.url)
            router = Router(pool, Exact(), RouterSettings(), PromptTokenizer(ByteTokenizer()))
            wb = pool.workers[b.url]
            assert wb.subscriber is not None and pool.workers[a.url].subscriber is None
            system = list(b"<system>You are a helpful pirate. Answer in rhymes.")
            pub.on_stored(system, 0)
            pub.end_step({"num_running": 0, "num_waiting": 0, "queued_prefill_tokens": 0, "kv_usage": 0.1,
                          "timestamp": __import__("time").time()})
            for _ in range(500):
                if wb.subscriber.synced and wb.subscriber.stream.index.num_tokens == len(system):
                    break
                await asyncio.sleep(0.01)
            async with Served(build_app(router)) as rsrv, httpx.AsyncClient(base_url=rsrv.url, timeout=30) as c:
                msgs = [{"role": "system", "content": "You are a helpful pirate. Answer in rhymes."},
                        {"role": "user", "content": "hello"}]
                r = await c.post("/v1/chat/completions", json={"messages": msgs})
                assert r.json()["worker"] == "b"
                assert wb.predicted_hit_tokens == len(system) and router.oracle_hit_tokens == len(system)
                assert wb.alive_at() > time.monotonic() - 5  # heartbeats: a slow /health will not fail it
                pub.on_removed(system, 0)  # b evicted the prefix
                pub.end_step({"num_running": 0, "num_waiting": 0, "queued_prefill_tokens": 0, "kv_usage": 0.0,
                              "timestamp": __import__("time").time()})
                for _ in range(500):
                    if wb.subscriber.stream.index.num_tokens == 0:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(2.1)  # the first answer's prompt stops counting as "just routed"
                r = await c.post("/v1/chat/completions", json={"messages": msgs})
                assert r.json()["worker"] == "a"  # the prefix is nowhere now, equal loads: the first
                m = (await c.get("/metrics")).text
                assert f'idleless_router_index_tokens{{worker="{b.url}"}} 0.0' in m
            await pool.stop()
            await client.aclose()

    try:
        run(main())
    finally:
        pub.close()


def test_health_checks_take_a_worker_out_and_back():
    """Two failed checks in a row (the threshold) mark a worker unhealthy and new traffic avoids it;
    one passing check brings it back (a restarted worker rejoins). A check that times out is no failure
    while the worker is still sending bytes; an unhealthy worker's requests end only once it has been
    silent for --dead-after-secs."""
    async def main():
        mode_a = {}
        async with Served(fake_worker("a", mode_a)) as a, Served(fake_worker("b", {})) as b:
            router, rsrv = await _router([a.url, b.url], "--policy", "round_robin", "--health-failure-threshold", "2",
                                         "--health-check-timeout-secs", "0.3")
            pool, wa = router.pool, router.pool.workers[a.url]
            async with rsrv, httpx.AsyncClient(base_url=rsrv.url, timeout=30) as c:
                mode_a["health"] = 503
                await pool.check(wa)
                assert wa.healthy  # one failure is below the threshold of 2
                await pool.check(wa)
                assert not wa.healthy and wa.dead.is_set()
                got = [(await c.post("/v1/completions", json={"prompt": "x"})).json()["worker"] for _ in range(3)]
                assert got == ["b", "b", "b"]
                mode_a["health"] = 200
                await pool.check(wa)
                assert wa.healthy and not wa.dead.is_set()
                # /health answers late (a busy engine): no failure while the worker still streams bytes ...
                mode_a["health_delay"] = 1.0
                wa.last_progress = time.monotonic()
                assert await pool.check(wa) is False and wa.healthy and wa.failures == 0
                # ... a worker silent for longer than the check's timeout but less than --dead-after-secs
                # gets no new traffic, yet its requests in flight go on ...
                wa.last_progress = time.monotonic() - 30
                await pool.check(wa)
                await pool.check(wa)
                assert not wa.healthy and not wa.dead.is_set()
                # ... and one silent for longer is dead: its requests end
                wa.last_progress = time.monotonic() - 61
                await pool.check(wa)
                assert not wa.healthy and wa.dead.is_set()
                mode_a["health_delay"] = 0
                await pool.check(wa)
                got = {(await c.post("/v1/completions", json={"prompt": "x"})).json()["worker"] for _ in range(2)}
                assert got == {"a", "b"}
            await pool.stop()

    run(main())
