"""/metrics under vLLM's names: the vllm: series are renamed views of the idleless: ones (same
observations, same buckets, ``finished_reason`` for ``finish_reason``, a ``model_name`` label), the KV
usage counts the radix cache's evictable tokens as free, and on a real server (the session's shared
one) the series move as a request runs: running 1 and KV in use while it streams, then every counter
and histogram count up by the hand-known amounts of that one request."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from idleless.telemetry.metrics import ServerMetrics, kv_cache_usage, kv_used_tokens

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.timeout(300)

# vllm: sample name -> the idleless: sample it must equal (same observations)
SAME = {
    "vllm:prompt_tokens_total": "idleless:prompt_tokens_total",
    "vllm:generation_tokens_total": "idleless:generation_tokens_total",
    "vllm:prefix_cache_queries_total": "idleless:prompt_tokens_total",
    "vllm:prefix_cache_hits_total": "idleless:cache_hit_tokens_total",
    "vllm:time_to_first_token_seconds_count": "idleless:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum": "idleless:time_to_first_token_seconds_sum",
    "vllm:inter_token_latency_seconds_count": "idleless:inter_token_latency_seconds_count",
    "vllm:inter_token_latency_seconds_sum": "idleless:inter_token_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count": "idleless:e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum": "idleless:e2e_request_latency_seconds_sum",
    "vllm:num_requests_running": "idleless:num_running_reqs",
    "vllm:num_requests_waiting": "idleless:num_waiting_reqs",
    "vllm:num_preemptions_total": "idleless:num_retractions_total",
}


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus text exposition: (name, labels) -> value."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(smp: dict, name: str, **labels) -> float:
    key = (name, frozenset({"model_name": MODEL, **labels}.items()))
    assert key in smp, f"{name} {labels} not exported"
    return smp[key]


def types(text: str) -> dict[str, str]:
    return {fam.name: fam.type for fam in text_string_to_metric_families(text)}


# ------------------------------------------------------------------------------------------------
# ServerMetrics alone
# ------------------------------------------------------------------------------------------------
def test_kv_usage_counts_evictable_cache_as_free():
    kv = {"total": 1000, "free": 300, "cached": 500, "in_use": 200, "evictable": 450}
    assert kv_used_tokens(kv) == 250 and kv_cache_usage(kv) == 0.25  # (1000 - 300 - 450) / 1000 by hand
    assert kv_cache_usage({"total": 1000, "free": 300}) == 0.7  # a report without evictable: all non-free
    assert kv_cache_usage({"total": 0, "free": 0}) == 0.0
    assert kv_cache_usage({"total": 64, "free": 64, "evictable": 0}) == 0.0


def test_vllm_series_are_the_idleless_observations_renamed():
    m = ServerMetrics(MODEL)
    m.observe_ttft(0.3)
    m.observe_itl(0.02, 3)
    m.observe_finished("stop", 10, 4, 5, 1.5)
    m.observe_finished("length", 7, 0, 2, 0.7)
    m.observe_finished("abort", 3, 3, 0, 0.1)
    m.update_core({"num_running": 2, "num_waiting": 1, "num_retractions": 6,
                   "kv": {"total": 100, "free": 40, "cached": 30, "in_use": 30, "evictable": 10}}, True)
    text = m.render().decode()
    smp = samples(text)
    # hand-computed from the observations above
    assert value(smp, "vllm:prompt_tokens_total") == 20 == value(smp, "vllm:prefix_cache_queries_total")
    assert value(smp, "vllm:prefix_cache_hits_total") == 7
    assert value(smp, "vllm:generation_tokens_total") == 7
    for reason, n in (("stop", 1), ("length", 1), ("abort", 1)):
        assert value(smp, "vllm:request_success_total", finished_reason=reason) == n
    assert value(smp, "vllm:time_to_first_token_seconds_count") == 1
    assert value(smp, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.3)
    assert value(smp, "vllm:inter_token_latency_seconds_count") == 3
    assert value(smp, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(2.3)
    assert value(smp, "vllm:e2e_request_latency_seconds_bucket", le="1.0") == 2  # 0.7 and 0.1
    assert value(smp, "vllm:num_requests_running") == 2 and value(smp, "vllm:num_requests_waiting") == 1
    assert value(smp, "vllm:num_preemptions_total") == 6
    assert value(smp, "vllm:kv_cache_usage_perc") == 0.5  # (100 - 40 - 10) / 100
    # every vllm: histogram bucket equals the idleless: one it renames
    for (name, labels), v in smp.items():
        if name.startswith("vllm:") and name.endswith("_bucket"):
            assert smp[("idleless:" + name[5:], labels)] == v
    t = types(text)
    assert t["vllm:request_success"] == t["vllm:prefix_cache_hits"] == "counter"
    assert t["vllm:time_to_first_token_seconds"] == t["vllm:inter_token_latency_seconds"] == "histogram"
    assert t["vllm:kv_cache_usage_perc"] == t["vllm:num_requests_running"] == "gauge"


def test_series_exist_before_any_request_and_core_ones_wait_for_a_snapshot():
    m = ServerMetrics(MODEL)
    smp = samples(m.render().decode())
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert value(smp, name) == 0
    assert value(smp, "vllm:request_success_total", finished_reason="stop") == 0
    assert not any(n == "vllm:num_requests_running" for n, _ in smp)  # no core snapshot yet


# ------------------------------------------------------------------------------------------------
# A real server
# ------------------------------------------------------------------------------------------------
def scrape(http) -> dict:
    r = http.get("/metrics")
    assert r.status_code == 200
    return samples(r.text)


def wait_idle(http, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        smp = scrape(http)
        if value(smp, "vllm:num_requests_running") == 0 and value(smp, "vllm:num_requests_waiting") == 0:
            return smp
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)


def test_vllm_names_move_as_a_request_runs(server, http):
    before = wait_idle(http)
    assert value(before, "vllm:num_requests_running") == 0
    body = {"model": MODEL, "prompt": "List the planets of the solar system, one per line:", "max_tokens": 160,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    during, usage, n_text_chunks = None, None, 0
    with http.stream("POST", "/v1/completions", json=body) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"]:
                n_text_chunks += 1
                if during is None:  # the first token is out, 159 to go: the request is in the running batch
                    during = scrape(http)
    assert during is not None and usage is not None
    assert value(during, "vllm:num_requests_running") == 1
    assert value(during, "vllm:num_requests_waiting") == 0
    assert 0 < value(during, "vllm:kv_cache_usage_perc") <= 1
    after = wait_idle(http)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    prompt, cached = usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert usage["completion_tokens"] == 160
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == 160
    assert delta("vllm:prefix_cache_queries_total") == prompt
    assert delta("vllm:prefix_cache_hits_total") == cached
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert 1 <= delta("vllm:inter_token_latency_seconds_count") <= 159  # tokens after the first delivery
    assert delta("vllm:e2e_request_latency_seconds_sum") >= delta("vllm:time_to_first_token_seconds_sum") > 0
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
    # one source of truth: each vllm: sample equals the idleless: sample it renames, in the same scrape
    for smp in (before, during, after):
        for v, i in SAME.items():
            assert value(smp, v) == value(smp, i), v
        for reason in ("stop", "length", "abort"):
            assert value(smp, "vllm:request_success_total", finished_reason=reason) == \
                value(smp, "idleless:num_requests_total", finish_reason=reason)
    assert all(dict(labels).get("model_name") == MODEL for name, labels in after if name.startswith("vllm:"))


def test_speculative_counters_under_both_names_hand_computed():
    """With speculative decoding the core's ``speculative`` stats appear as idleless:spec_* and vLLM's
    vllm:spec_decode_* counters, the same values; without it (empty stats) neither appears."""
    m = ServerMetrics("tiny")
    spec = {"algorithm": "ngram", "num_drafts": 7, "num_draft_tokens": 30, "num_accepted_tokens": 12,
            "num_steps_on": 5, "num_steps_off": 2, "acceptance_rate": 0.4, "mean_accepted_length": 19 / 7}
    m.update_core({"kv": {"total": 10, "free": 10}, "speculative": spec}, True)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}

    def value(name):
        return fams[name].samples[0].value

    assert value("idleless:spec_num_draft_tokens") == 30 == value("vllm:spec_decode_num_draft_tokens")
    assert value("idleless:spec_num_accepted_tokens") == 12 == value("vllm:spec_decode_num_accepted_tokens")
    assert value("idleless:spec_num_drafts") == 7 == value("vllm:spec_decode_num_drafts")
    assert value("idleless:spec_steps_off") == 2 and value("idleless:spec_steps_on") == 5
    assert value("idleless:spec_acceptance_rate") == pytest.approx(0.4)
    assert value("idleless:spec_mean_accepted_length") == pytest.approx(19 / 7)
    assert fams["vllm:spec_decode_num_drafts"].samples[0].labels == {"model_name": "tiny"}
    plain = ServerMetrics("tiny")
    plain.update_core({"kv": {"total": 10, "free": 10}, "speculative": {}}, True)
    assert "spec" not in plain.render().decode()


def test_kv_transfer_counters_follow_the_engines_side():
    """A decode engine's kv_transfer stats appear as idleless:kv_transfer_* counters (only the keys its
    side reports); a colocated engine (empty stats) shows none."""
    m = ServerMetrics("tiny")
    kvt = {"mode": "decode", "num_pulls": 4, "num_transfers": 3, "num_tokens_received": 300,
           "bytes_received": 4800, "num_skipped_tokens": 40, "num_fallbacks": 1, "num_errors": 0,
           "seconds": 0.25, "num_pending": 0, "gb_per_s": 1.9e-5}
    m.update_core({"kv": {"total": 10, "free": 10}, "kv_transfer": kvt}, True)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert fams["idleless:kv_transfer_tokens_received"].samples[0].value == 300
    assert fams["idleless:kv_transfer_bytes_received"].samples[0].value == 4800
    assert fams["idleless:kv_transfer_fallbacks"].samples[0].value == 1
    assert fams["idleless:kv_transfer_seconds"].samples[0].value == 0.25
    assert "idleless:kv_transfer_bytes_sent" not in fams  # a prefill engine's counter
    plain = ServerMetrics("tiny")
    plain.update_core({"kv": {"total": 10, "free": 10}, "kv_transfer": {}}, True)
    assert not [f for f in text_string_to_metric_families(plain.render().decode()) if "kv_transfer" in f.name]
