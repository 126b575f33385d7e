"""SGLang's info routes on a real server (the session's shared one): /v1/loads (the load report),
/get_model_info (and /model_info) and /get_server_info carry SGLang's field names with values that
match what the server was started with and what /server_info reports; they sit behind the API key."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import httpx
import pytest

from server_harness import MAIN_API_KEY
from idleless.config import EngineConfig
from idleless.server import routes_admin
from idleless.server.routes_admin import TokenRate, sglang_aggregate, sglang_load

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.timeout(300)

LOAD_FIELDS = {"dp_rank", "timestamp", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens",
               "max_total_num_tokens", "token_usage", "gen_throughput", "cache_hit_rate", "max_running_requests"}


def test_sglang_load_from_engine_stats():
    stats = {"num_running": 3, "num_waiting": 2, "window_hit_rate": 0.123456,
             "kv": {"total": 4000, "free": 1000, "cached": 2500, "in_use": 500, "evictable": 2000}}
    d = sglang_load(stats, 256, 41.2345)
    assert set(d) == LOAD_FIELDS
    assert (d["num_running_reqs"], d["num_waiting_reqs"], d["num_total_reqs"]) == (3, 2, 5)
    assert d["num_used_tokens"] == 1000 and d["max_total_num_tokens"] == 4000  # 4000 - 1000 free - 2000 evictable
    assert d["token_usage"] == 0.25 and d["cache_hit_rate"] == 0.1235 and d["gen_throughput"] == 41.23
    agg = sglang_aggregate([d, {**d, "num_running_reqs": 1, "num_total_reqs": 3, "token_usage": 0.75}])
    assert agg == {"total_running_reqs": 4, "total_waiting_reqs": 4, "total_reqs": 8, "total_used_tokens": 2000,
                   "avg_token_usage": 0.5, "avg_throughput": 41.23}


def test_token_rate_is_the_growth_over_the_interval(monkeypatch):
    clock = iter([100.0, 102.0, 102.5, 104.5])
    monkeypatch.setattr(routes_admin, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    r = TokenRate()                 # t = 100, total 0
    assert r.read(50) == 25.0       # 50 tokens in 2 s
    assert r.read(50) == 0.0        # none in 0.5 s
    assert r.read(60) == 5.0        # 10 in 2 s


def test_routes_need_the_api_key(server):
    for path in ("/v1/loads", "/get_model_info", "/model_info", "/get_server_info"):
        assert httpx.get(server.url + path, timeout=60).status_code == 401, path


def test_loads(server, http):
    server.wait_idle_kv()
    info = http.get("/server_info").json()
    http.get("/v1/loads")  # starts a fresh throughput interval
    r = http.post("/generate", json={"text": "Count to ten:", "sampling_params": {"max_new_tokens": 12,
                                                                                  "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 12
    server.wait_idle_kv()
    body = http.get("/v1/loads").json()
    assert set(body) == {"timestamp", "version", "dp_rank_count", "loads", "aggregate"}
    assert body["dp_rank_count"] == 1 and len(body["loads"]) == 1 and body["version"] == "0.1.0"
    load = body["loads"][0]
    assert set(load) == LOAD_FIELDS
    assert load["dp_rank"] == 0 and load["num_running_reqs"] == load["num_waiting_reqs"] == load["num_total_reqs"] == 0
    assert load["max_total_num_tokens"] == info["kv_slots"] and load["max_running_requests"] == 256
    assert 0 <= load["num_used_tokens"] <= load["max_total_num_tokens"]
    assert load["token_usage"] == round(load["num_used_tokens"] / load["max_total_num_tokens"], 4)
    assert load["gen_throughput"] > 0  # 12 tokens were generated in the interval
    now = time.time()  # the report's timestamp is the current Unix time (not a speed check)
    assert abs(load["timestamp"] - now) < 300
    assert body["aggregate"] == sglang_aggregate([load])
    again = http.get("/v1/loads").json()["loads"][0]
    assert again["gen_throughput"] == 0.0  # nothing generated since


def test_loads_count_a_running_request(server, http):
    body = {"model": MODEL, "prompt": "Tell a long story:", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "stream": True}
    load = None
    with http.stream("POST", "/v1/completions", json=body) as s:
        for line in s.iter_lines():
            if line.startswith("data: {") and load is None:
                load = http.get("/v1/loads").json()["loads"][0]
    assert load["num_running_reqs"] == 1 and load["num_total_reqs"] == 1
    assert 0 < load["num_used_tokens"] and 0 < load["token_usage"] <= 1


def test_model_info(server, http):
    info = http.get("/server_info").json()
    for path in ("/get_model_info", "/model_info"):
        m = http.get(path).json()
        assert m["model_path"] == info["model_path"] and m["tokenizer_path"] == info["model_path"]
        assert m["is_generation"] is True and m["weight_version"] == "default"
        assert m["preferred_sampling_params"] is None
        assert m["has_image_understanding"] is False and m["has_audio_understanding"] is False
        assert m["model_type"] == "llama" and m["architectures"] == ["LlamaForCausalLM"]  # SmolLM2 is a Llama


def test_get_server_info(server, http):
    r = http.get("/get_server_info")
    assert r.status_code == 200
    si, info = r.json(), http.get("/server_info").json()
    # server args: every EngineConfig field, as started (server_harness.MAIN_ARGS), and SGLang's names
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= set(si)
    assert (si["dtype"], si["kv_cache_memory"], si["num_threads"], si["log_level"]) == ("float32", "256MiB", 1,
                                                                                         "warning")
    assert si["max_running_requests"] == 256 and si["disable_radix_cache"] is False and si["model"] is None
    # the resolved numerics mode: float32's default is the non-invariant kernels
    assert si["enable_deterministic_inference"] is False and info["deterministic_inference"] is False
    assert si["model_path"] == si["tokenizer_path"] == info["model_path"]
    assert si["random_seed"] == si["seed"] == 0 and si["tp_size"] == 1 and si["dp_size"] == 1
    assert si["host"] == "127.0.0.1" and si["port"] == server.port
    # scheduler info and runtime stats
    assert si["max_total_num_tokens"] == info["kv_slots"]
    assert si["max_req_input_len"] == min(info["context_length"], info["kv_slots"])
    assert len(si["internal_states"]) == 1
    state = si["internal_states"][0]
    assert state["kv"]["total"] == info["kv_slots"] and {"num_running", "num_waiting", "num_steps"} <= set(state)
    assert si["version"] == "0.1.0"
    assert "api_key" not in si and MAIN_API_KEY not in r.text
