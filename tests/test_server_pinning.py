"""Prefix pinning over HTTP: POST /pin_prefix and /unpin_prefix behind the API key, their 400s
(bad input, pinned budget exceeded, prefix cache disabled), the frontend's admission limit lowered
by what is pinned, and a pinned prefix that stays cached while one-off prompts churn a small pool.

Two servers, started in parallel: a small float32 one (8 MiB of KV, about 180 tokens; at most 64
pinned tokens) and one with the prefix cache disabled."""

from __future__ import annotations

import httpx
import pytest

from server_harness import ServerProcess

pytestmark = pytest.mark.timeout(300)
KEY = "pin-key"
BUDGET = 64
COMMON = ["--dtype", "float32", "--num-threads", "1", "--log-level", "warning"]
SMALL = COMMON + ["--kv-cache-memory", "8MiB", "--max-pinned-tokens", str(BUDGET)]
NOCACHE = COMMON + ["--kv-cache-memory", "8MiB", "--disable-radix-cache"]


@pytest.fixture(scope="module")
def servers(smollm2_dir):
    small, nocache = ServerProcess(SMALL, api_key=KEY), ServerProcess(NOCACHE, api_key=KEY)
    try:
        small.wait_ready()
        nocache.wait_ready()
        yield small, nocache
    finally:
        small.stop()
        nocache.stop()


@pytest.fixture(scope="module")
def http(servers):
    with httpx.Client(base_url=servers[0].url, headers=servers[0].headers, timeout=120) as c:
        yield c


def tokens(n: int, start: int = 1000) -> list[int]:
    """``n`` distinct ordinary token ids (no specials, no eos)."""
    return list(range(start, start + n))


def assert_error(r, status, code=None, param=None):
    """``r`` is the OpenAI error object with ``status``, and ``code`` / ``param`` when given."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def test_pin_and_unpin_need_the_api_key(servers):
    small, _ = servers
    for path, body in (("/pin_prefix", {"input_ids": [1000, 1001], "ttl_s": 60}), ("/unpin_prefix", {"pin_id": "x"})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert_error(httpx.post(small.url + path, json=body, headers=headers), 401, "invalid_api_key")
    assert httpx.get(small.url + "/server_info", headers=small.headers).json()["stats"]["pinned_tokens"] == 0


def test_pin_unpin_round_trip(servers, http):
    small, _ = servers
    ids = tokens(40)
    r = http.post("/pin_prefix", json={"input_ids": ids, "ttl_s": 60, "pin_id": "sys"})
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "pin_id": "sys", "num_tokens": 40, "ttl_s": 60.0}
    assert small.stats()["pinned_tokens"] == 40
    # text is tokenized as a completion prompt is; without pin_id a new id is made
    text = "You are a helpful assistant. Answer briefly."
    n_text = len(http.post("/v1/tokenize", json={"prompt": text}).json()["tokens"])
    r = http.post("/pin_prefix", json={"text": text})
    assert r.status_code == 200, r.text
    auto_id, got = r.json()["pin_id"], r.json()
    assert auto_id and auto_id != "sys" and got["num_tokens"] == n_text and got["ttl_s"] == 600.0
    assert small.stats()["pinned_tokens"] == 40 + n_text
    assert http.post("/unpin_prefix", json={"pin_id": auto_id}).json() == {"success": True, "pin_id": auto_id}
    assert http.post("/unpin_prefix", json={"pin_id": "sys"}).status_code == 200
    assert small.stats()["pinned_tokens"] == 0
    assert_error(http.post("/unpin_prefix", json={"pin_id": "sys"}), 404, "pin_not_found", "pin_id")


@pytest.mark.parametrize("body,param,code", [
    ({"ttl_s": 60}, "input_ids", "invalid_value"),                                 # neither
    ({"input_ids": [1000], "text": "hi"}, "input_ids", "invalid_value"),            # both
    ({"input_ids": []}, "input_ids", "invalid_prompt"),
    ({"input_ids": [10**9]}, "input_ids", "invalid_prompt"),                       # outside the vocabulary
    ({"input_ids": [1000, "a"]}, "input_ids[1]", None),
    ({"input_ids": [1000] * 400}, "input_ids", "context_length_exceeded"),         # more than the pool
    ('{"text": "\\ud800"}', "text", "invalid_value"),                               # a lone surrogate
    ({"input_ids": [1000], "ttl_s": 0}, "ttl_s", "invalid_value"),
    ({"input_ids": [1000], "ttl_s": -5}, "ttl_s", "invalid_value"),
    ({"input_ids": [1000], "ttl_s": "long"}, "ttl_s", None),
    ({"input_ids": [1000], "pin_id": ""}, "pin_id", None),
    # no lax coercion into token ids or seconds (found by the fresh-clone pass: these pinned)
    ({"input_ids": [True, 1000]}, None, None),
    ({"input_ids": ["5", 1000]}, None, None),
    ({"input_ids": [1.0, 1000]}, None, None),
    ({"text": "hi there", "ttl_s": "10"}, "ttl_s", None),
])
def test_bad_pin_input_is_400(servers, http, body, param, code):
    if isinstance(body, str):  # raw JSON (a lone surrogate has no UTF-8 form, so no client encodes it)
        r = http.post("/pin_prefix", content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post("/pin_prefix", json=body)
    err = assert_error(r, 400, code, param)
    assert err["type"] == "invalid_request_error"
    assert servers[0].stats()["pinned_tokens"] == 0


def test_bad_unpin_input_is_400(http):
    assert_error(http.post("/unpin_prefix", json={}), 400, "invalid_value", "pin_id")
    assert_error(http.post("/unpin_prefix", json={"pin_id": 5}), 400, "invalid_type", "pin_id")


def test_pinned_budget_exceeded_is_400(servers, http):
    small, _ = servers
    a, b = tokens(40, 2000), tokens(40, 3000)
    assert http.post("/pin_prefix", json={"input_ids": a, "pin_id": "a"}).status_code == 200
    err = assert_error(http.post("/pin_prefix", json={"input_ids": b, "pin_id": "b"}), 400, "pin_refused", "input_ids")
    assert "budget" in err["message"] and str(BUDGET) in err["message"]
    assert small.stats()["pinned_tokens"] == 40
    # re-pinning an id replaces its pin (40 -> 50 tokens fits the budget; 40 + 50 would not)
    r = http.post("/pin_prefix", json={"input_ids": a + tokens(10, 4000), "pin_id": "a"})
    assert r.status_code == 200 and r.json()["num_tokens"] == 50, r.text
    assert small.stats()["pinned_tokens"] == 50
    assert http.post("/unpin_prefix", json={"pin_id": "a"}).status_code == 200
    assert http.post("/pin_prefix", json={"input_ids": b, "pin_id": "b"}).status_code == 200  # fits now
    assert http.post("/unpin_prefix", json={"pin_id": "b"}).status_code == 200


def test_prefix_cache_disabled_is_400(servers):
    _, nocache = servers
    with httpx.Client(base_url=nocache.url, headers=nocache.headers, timeout=60) as c:
        err = assert_error(c.post("/pin_prefix", json={"input_ids": [1000, 1001]}), 400, "prefix_cache_disabled")
        assert "disabled" in err["message"]
        assert_error(c.post("/unpin_prefix", json={"pin_id": "x"}), 400, "prefix_cache_disabled")
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200  # still serving


def test_pinned_tokens_lower_the_request_limit(servers, http):
    """What is pinned is unavailable to requests: the frontend refuses prompt + max_tokens over
    kv_slots - pinned with the engine's own rule, and accepts it again once unpinned."""
    small, _ = servers
    slots = http.get("/server_info").json()["kv_slots"]
    assert 100 < slots < 300
    prompt = tokens(5, 5000)
    body = {"prompt": prompt, "max_tokens": slots - len(prompt) - 30, "stream": True, "ignore_eos": True}
    assert http.post("/pin_prefix", json={"input_ids": tokens(40), "pin_id": "p"}).status_code == 200
    err = assert_error(http.post("/v1/completions", json=body), 400, "context_length_exceeded", "max_tokens")
    assert "40 of them pinned" in err["message"]
    assert http.post("/unpin_prefix", json={"pin_id": "p"}).status_code == 200
    with http.stream("POST", "/v1/completions", json=body) as s:  # accepted now: read one chunk, then leave
        assert s.status_code == 200
        next(line for line in s.iter_lines() if line.startswith("data: "))
    small.wait_idle_kv()


def test_pinned_prefix_survives_a_flood_of_one_off_prompts(servers, http):
    small, _ = servers
    assert http.post("/flush_cache").json()["success"]
    hot, cold = tokens(48, 6000), tokens(48, 6500)  # the same length; only the first is pinned
    assert http.post("/pin_prefix", json={"input_ids": hot, "pin_id": "hot", "ttl_s": 120}).json()["num_tokens"] == 48
    assert http.post("/v1/completions", json={"prompt": cold, "max_tokens": 2, "ignore_eos": True}).status_code == 200
    for i in range(8):  # 8 x 62 tokens through a pool of about 180: everything unpinned is evicted
        r = http.post("/v1/completions", json={"prompt": tokens(60, 7000 + 100 * i), "max_tokens": 2,
                                               "ignore_eos": True})
        assert r.status_code == 200, r.text
    assert small.stats()["evicted_tokens"] > 0
    def cached(prefix):
        r = http.post("/v1/completions", json={"prompt": prefix + [42, 43], "max_tokens": 1})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(hot) == 48 and cached(cold) == 0
    assert http.post("/unpin_prefix", json={"pin_id": "hot"}).status_code == 200
    small.wait_idle_kv()
