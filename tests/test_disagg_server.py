"""Prefill/decode disaggregation through HTTP (issue 18): a prefill server, a decode server and the PD
router (``idleless router --pd-disaggregation``) on 127.0.0.1 with the bundled SmolLM2.

Reference: the decode server answering the same request itself (no kv_transfer_params). Deterministic
inference is on, so the tokens and logprobs must agree bitwise whether the prompt's KV was pulled from
the prefill server, computed there, or partly cached. Then the prefill server is killed: requests
still succeed (the decode server prefills them itself) and nothing hangs.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from server_harness import PDRouter, ServerProcess, free_port

pytestmark = pytest.mark.slow

ARGS = ["--dtype", "float32", "--kv-cache-memory", "96MiB", "--num-threads", "1", "--log-level", "warning",
        "--enable-deterministic-inference"]


@pytest.fixture(scope="module")
def pd(smollm2_dir):
    bootstrap = free_port()
    p = ServerProcess(ARGS + ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)])
    d = ServerProcess(ARGS + ["--disaggregation-mode", "decode", "--disaggregation-timeout", "20"])
    router = PDRouter(p, d, [], prefill_timeout_s=30)
    try:
        p.wait_ready()
        d.wait_ready()
        yield p, d, router.start()
    finally:
        router.stop()
        p.stop()
        d.stop()


PREFIX = list(range(1000, 1160))


def _body(prompt, **kw):
    return {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1, **kw}


def _answer(r: httpx.Response):
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"]


def _kv(d) -> dict:
    return d.stats()["kv_transfer"]


def test_pd_equals_the_decode_server_alone_bitwise_and_pulls_only_the_suffix(pd):
    p, d, url = pd
    model = httpx.get(d.url + "/v1/models").json()["data"][0]["id"]
    prompt = PREFIX + [2000 + i for i in range(40)]
    via_pd = _answer(httpx.post(url + "/v1/completions", json=_body(prompt, model=model), timeout=300))
    st = _kv(d)
    assert st["num_transfers"] == 1 and st["num_tokens_received"] == len(prompt) - 1
    alone = _answer(httpx.post(d.url + "/v1/completions", json=_body(prompt, model=model), timeout=300))
    assert via_pd == alone  # text and every logprob, bitwise (JSON floats round-trip exactly)
    assert httpx.post(d.url + "/flush_cache").status_code == 200
    cold = _answer(httpx.post(d.url + "/v1/completions", json=_body(prompt, model=model), timeout=300))
    assert cold == alone

    # A second prompt sharing PREFIX: the decode server holds it (from the pull above? flushed: from
    # this cold run), so only the rest travels.
    second = PREFIX + [3000 + i for i in range(30)]
    before = _kv(d)
    via_pd = _answer(httpx.post(url + "/v1/completions", json=_body(second, model=model), timeout=300))
    after = _kv(d)
    assert after["num_skipped_tokens"] - before["num_skipped_tokens"] >= len(PREFIX)
    assert after["num_tokens_received"] - before["num_tokens_received"] == len(second) - 1 - (
        after["num_skipped_tokens"] - before["num_skipped_tokens"])
    assert via_pd == _answer(httpx.post(d.url + "/v1/completions", json=_body(second, model=model), timeout=300))


def test_streamed_chat_through_pd_equals_the_unstreamed_answer(pd):
    p, d, url = pd
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    whole = httpx.post(url + "/v1/chat/completions", timeout=300,
                       json={"messages": msgs, "max_tokens": 16, "temperature": 0})
    assert whole.status_code == 200, whole.text
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=300,
                      json={"messages": msgs, "max_tokens": 16, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    text += ch["delta"].get("content") or ""
    assert text == whole.json()["choices"][0]["message"]["content"]


def test_ttft_split_of_a_streamed_request_fits_in_the_ttft_the_client_saw(pd):
    """Queue and prefill (timed by the prefill server), transfer and first decode (the decode server):
    present, >= 0, and summing to at most the client's TTFT (plus 50 ms for the HTTP hops' clock
    reads; the parts are disjoint intervals of the request's life). The router's /metrics shows them."""
    p, d, url = pd
    before = _kv(d)["ttft_split"]["count"]
    prompt = [5000 + i for i in range(120)]
    t0 = time.monotonic()
    ttft = None
    with httpx.stream("POST", url + "/v1/completions", timeout=300,
                      json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                ttft = time.monotonic() - t0
    split = _kv(d)["ttft_split"]
    assert split["count"] == before + 1
    rec = split["recent"][-1]
    parts = [rec[k] for k in ("queue_s", "prefill_s", "transfer_s", "first_decode_s")]
    assert all(v is not None and v >= 0 for v in parts), rec
    assert sum(parts) <= ttft + 0.05, (rec, ttft)
    metrics = httpx.get(url + "/metrics", timeout=30).text
    for part in ("queue", "prefill", "transfer", "first_decode"):
        assert f'idleless_router_pd_ttft_{part}_seconds_count{{worker="{d.url}"}}' in metrics
    mine = ("idleless_router_pd_ttft_seconds_count", "idleless_router_pd_prefill_leg_seconds_count")
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith(mine)}
    assert counts["idleless_router_pd_ttft_seconds_count"] >= 1  # this streamed request (and the chat one)
    assert counts["idleless_router_pd_prefill_leg_seconds_count"] >= 1


def test_a_dead_prefill_server_falls_back_to_decode_side_prefill(pd):
    p, d, url = pd
    p.stop(signal.SIGKILL)
    prompt = [4000 + i for i in range(50)]
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=_body(prompt), timeout=120)
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 100  # ended, not hung
    assert _answer(r) == _answer(httpx.post(d.url + "/v1/completions", json=_body(prompt), timeout=120))
    workers = httpx.get(url + "/workers").json()
    assert workers["counters"]["prefill_failed"] + workers["counters"]["prefill_skipped"] >= 1
    assert _kv(d)["num_pending"] == 0


def test_a_colocated_server_refuses_kv_transfer_params(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                           "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params" and "--disaggregation-mode" in err["message"]
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "kv_transfer_params": None}
                     ).status_code == 200
