"""Layer-wise PD through HTTP (issue 18, item 2): a prefill server, a decode server and ``idleless
router --pd-disaggregation --pd-layerwise`` on 127.0.0.1 with the bundled SmolLM2. The router starts
both legs at once; the decode server receives the KV layer by layer while the prefill server computes
it. Reference: the decode server answering alone (deterministic inference: bitwise). Then the prefill
server is SIGKILLed while it streams a long prompt: the request still ends (the decode server sees
the connection close, or at worst its --disaggregation-timeout passes, and recomputes) and the decode
server holds no slot afterwards.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from server_harness import PDRouter, ServerProcess, free_port

pytestmark = pytest.mark.slow

ARGS = ["--dtype", "float32", "--kv-cache-memory", "96MiB", "--num-threads", "1", "--log-level", "warning",
        "--enable-deterministic-inference"]


@pytest.fixture(scope="module")
def pd(smollm2_dir):
    p = ServerProcess(ARGS + ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(free_port()),
                              "--chunked-prefill-size", "256"])
    d = ServerProcess(ARGS + ["--disaggregation-mode", "decode", "--disaggregation-timeout", "15"])
    router = PDRouter(p, d, ["--pd-layerwise"], prefill_timeout_s=60)
    try:
        p.wait_ready()
        d.wait_ready()
        yield p, d, router.start()
    finally:
        router.stop()
        p.stop()
        d.stop()


def _body(prompt, **kw):
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1, **kw}


def _answer(r: httpx.Response):
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"]


def _kv(srv) -> dict:
    return srv.stats()["kv_transfer"]


def test_layerwise_equals_the_decode_server_alone_bitwise(pd):
    p, d, url = pd
    prompt = [1000 + i for i in range(600)]  # 3 chunks on the prefill server
    via_pd = _answer(httpx.post(url + "/v1/completions", json=_body(prompt), timeout=300))
    st, ps = _kv(d), _kv(p)
    assert st["num_layerwise"] == 1 and st["num_transfers"] == 1 and st["num_fallbacks"] == 0, st
    assert st["num_tokens_received"] == len(prompt) - 1
    assert st["num_layer_messages"] >= 2 and ps["num_streams"] == 1, (st, ps)
    alone = _answer(httpx.post(d.url + "/v1/completions", json=_body(prompt), timeout=300))
    assert via_pd == alone  # text and every logprob, bitwise (JSON floats round-trip exactly)


def test_prefill_server_killed_mid_stream_ends_the_request_and_leaks_no_slot(pd):
    p, d, url = pd
    prompt = [3000 + i for i in range(1800)]
    before = _kv(d)["num_layer_messages"]
    result: dict = {}

    def send():
        result["r"] = httpx.post(url + "/v1/completions", json=_body(prompt), timeout=120)

    t = threading.Thread(target=send)
    t0 = time.monotonic()
    t.start()
    while _kv(d)["num_layer_messages"] == before:  # the first layers have arrived: P is mid-prefill
        assert time.monotonic() - t0 < 100 and t.is_alive(), "no layer reached the decode server"
        time.sleep(0.05)
    p.stop(signal.SIGKILL)
    t.join(120)
    assert not t.is_alive(), "the request hung"
    assert _answer(result["r"]) == _answer(httpx.post(d.url + "/v1/completions", json=_body(prompt), timeout=120))
    st = _kv(d)
    assert st["num_fallbacks"] == 1 and st["num_pending"] == 0, st
    assert httpx.post(d.url + "/flush_cache", timeout=30).status_code == 200
    kv = d.stats()["kv"]
    assert kv["free"] == kv["total"], kv  # every slot the stream had is free again
