"""The router in front of two real engine replicas (tiny random model with SmolLM2's tokenizer), one of
which is killed with SIGKILL while it streams: the stream that had started on it ends with an error event
and ``[DONE]`` (never a hang), new traffic goes to the survivor, and the replica restarted on the same
port is taken back by the health checks and gets traffic again (issue 17's "a killed worker" test with
real engines; tests/test_router_proxy.py covers the same rules on scripted fake workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from server_harness import ServerProcess, free_port
from test_router_replicas import tiny_chat_model  # noqa: F401  (module fixture)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--num-threads", "1", "--log-level", "warning"]


def _router(workers: list[str]) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="idleless-router-", suffix=".log")
    cmd = [sys.executable, "-m", "idleless.cli", "router", "--host", "127.0.0.1", "--port", str(port),
           "--policy", "round_robin", "--health-check-interval-secs", "0.3", "--health-check-timeout-secs", "2",
           "--health-failure-threshold", "1", "--dead-after-secs", "3", "--worker-urls", *workers]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True)
    os.close(fd)
    return proc, f"http://127.0.0.1:{port}", log_path


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = predicate()
        except httpx.HTTPError:
            got = None
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _health(c: httpx.Client) -> dict:
    return {w["url"]: w["healthy"] for w in c.get("/workers").json()["workers"]}


def test_killed_replica_ends_its_stream_and_a_restarted_one_rejoins(tiny_chat_model):  # noqa: F811
    engines = [ServerProcess(["--model", tiny_chat_model, *ENGINE_ARGS]) for _ in range(2)]
    router = None
    try:
        for e in engines:
            e.wait_ready(timeout=400)
        router, url, router_log = _router([e.url for e in engines])
        with httpx.Client(base_url=url, timeout=60) as c:
            _wait(lambda: len(_health(c)) == 2 and all(_health(c).values()), 60, "both workers healthy")
            body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as s:
                assert s.status_code == 200
                lines = s.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["text"] is not None
                routed = {w["url"]: w["routed"] for w in c.get("/workers").json()["workers"]}
                victim = next(e for e in engines if routed[e.url] == 1)
                survivor = next(e for e in engines if e is not victim)
                os.killpg(victim.proc.pid, signal.SIGKILL)
                # the stream ends (the router's --dead-after-secs is 3; the module's timeout bounds a hang)
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert "error" in json.loads(rest[-2][6:]), rest[-3:]
            victim.stop()
            _wait(lambda: _health(c)[victim.url] is False, 30, "the killed worker marked unhealthy")
            for _ in range(3):
                r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
                assert r.status_code == 200, r.text
            routed_after = {w["url"]: w["routed"] for w in c.get("/workers").json()["workers"]}
            assert routed_after[survivor.url] == routed[survivor.url] + 3
            assert routed_after[victim.url] == routed[victim.url]
            # the same replica started again on the same port: the health checks take it back
            engines[engines.index(victim)] = restarted = ServerProcess(["--model", tiny_chat_model, *ENGINE_ARGS],
                                                                       port=victim.port)
            restarted.wait_ready(timeout=400)
            _wait(lambda: _health(c)[restarted.url], 30, "the restarted worker healthy again")
            for _ in range(4):
                assert c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
            final = {w["url"]: w["routed"] for w in c.get("/workers").json()["workers"]}
            assert final[restarted.url] >= routed[victim.url] + 1  # round robin sends it traffic again
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(30)
            except subprocess.TimeoutExpired:
                router.kill()
        for e in engines:
            e.stop()
