"""Speculative decoding through the real server (``--speculative-algorithm ngram``) on SmolLM2.

The reference is the ONE offline session Engine without speculation (float32, the same kernels): a
verify's rows go through the same per-row linear and decode-attention kernels as a decode step, so
greedy text must be identical. Also: a stop string that ends inside an accepted run cuts the text and
the token count there, streaming gives the same text, /server_info names the algorithm, and the
speculative counters move under both metric names.
"""

from __future__ import annotations

import json

import httpx
import pytest

from idleless.engine.request import SamplingParams
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

PASSAGE = ("The lighthouse keeper climbed the narrow stairs every evening at dusk. He trimmed the wick, "
           "polished the great lens, and wrote the weather in a leather book. Ships passed far out at sea, "
           "and none of them ever knew his name.")
MESSAGES = [{"role": "user", "content": f"Repeat the following passage exactly.\n\n{PASSAGE}"}]


@pytest.fixture(scope="module")
def spec_server(smollm2_dir):
    srv = ServerProcess(["--dtype", "float32", "--weight-dtype", "bf16", "--kv-cache-memory", "256MiB", "--num-threads", "1",
                         "--log-level", "warning", "--speculative-algorithm", "ngram"])
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(smollm2_engine):
    out = smollm2_engine.generate(MESSAGES, SamplingParams(temperature=0.0, max_new_tokens=60), use_tqdm=False)
    assert len(out.token_ids) >= 20
    return out


def _chat(srv, **kw):
    body = {"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, "temperature": 0, "max_tokens": 60, **kw}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_greedy_text_equals_plain_decoding_and_counters_move(spec_server, reference):
    before = httpx.get(spec_server.url + "/metrics", timeout=30).text
    got = _chat(spec_server)
    assert got["choices"][0]["message"]["content"] == reference.text
    assert got["usage"]["completion_tokens"] == len(reference.token_ids)
    after = httpx.get(spec_server.url + "/metrics", timeout=30).text
    for name in ("idleless:spec_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert _metric(after, name) > _metric(before, name), name
    info = httpx.get(spec_server.url + "/server_info", timeout=30).json()
    assert info["speculative_algorithm"] == "ngram"
    assert info["stats"]["speculative"]["acceptance_rate"] > 0
    spec_server.wait_idle_kv()


def test_a_stop_string_inside_an_accepted_run_cuts_text_and_count(spec_server, reference):
    text = reference.text
    stop = "polished"
    assert stop in text
    stats0 = httpx.get(spec_server.url + "/server_info", timeout=30).json()["stats"]
    got = _chat(spec_server, stop=[stop])
    choice = got["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[:text.index(stop)]
    # the tokens counted are those up to the one that completed the stop string
    assert got["usage"]["completion_tokens"] < len(reference.token_ids)
    chunks = []
    with httpx.stream("POST", spec_server.url + "/v1/chat/completions", timeout=300,
                      json={"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, "temperature": 0, "max_tokens": 60, "stream": True,
                            "stop": [stop]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":

                for c in json.loads(line[6:])["choices"]:
                    chunks.append(c["delta"].get("content") or "")
    assert "".join(chunks) == text[:text.index(stop)]
    spec_server.wait_idle_kv()
    # the frontend ends a request at a stop string and tells the engine: counted finished, not aborted
    stats = httpx.get(spec_server.url + "/server_info", timeout=30).json()["stats"]
    assert stats["num_aborted"] == stats0["num_aborted"] and stats["num_finished"] == stats0["num_finished"] + 2
