"""End-to-end tests of `idleless serve`: a real server (uvicorn on 127.0.0.1, free port, its own
process + the engine-core process) driven by the official openai client and httpx.

One server for the session (shared with test_server_fuzz.py). It runs float32 (explicitly; the
default is bfloat16) because the 32-client test compares with the offline Engine token for token:
bf16 CPU matmuls are not batch-invariant (a different batch composition flips greedy near-ties
within a few dozen tokens), float32 ones are on these prompts.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from server_harness import MAIN_API_KEY

API_KEY = MAIN_API_KEY
MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(user: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": user}]


def stream_text(stream, n: int = 1):
    """Concatenate streamed chat/completion deltas per choice; returns (texts, finish_reasons, chunks)."""
    texts = [""] * n
    finishes: dict[int, list] = {i: [] for i in range(n)}
    chunks = []
    for ch in stream:
        chunks.append(ch)
        for c in ch.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] += piece or ""
            if c.finish_reason is not None:
                finishes[c.index].append(c.finish_reason)
    return texts, finishes, chunks


# ------------------------------------------------------------------------------------------------
# Basic routes
# ------------------------------------------------------------------------------------------------
def test_cli_serve_help():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "idleless.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--model", "--host", "--port", "--dtype", "--kv-cache-memory", "--max-running-requests",
                 "--max-prefill-tokens", "--schedule-policy", "--disable-radix-cache", "--api-key",
                 "--served-model-name", "--max-queued-requests", "--log-level"):
        assert flag in out.stdout, flag


def test_health_models_and_auth(server, client):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_auth_scheme_is_case_insensitive(server):
    """RFC 7235 section 2.1: the scheme is case-insensitive, so ``bearer <key>`` is accepted."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                   headers={"Authorization": f"bearer {API_KEY}"}, timeout=120)
    assert r.status_code == 200, r.text


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=chat("Write one sentence about the sea.", "You are a poet."),
              max_tokens=12, temperature=0.8, top_p=0.95, seed=1234)
    full = client.chat.completions.create(**kw)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.system_fingerprint and full.system_fingerprint.startswith("idleless-")
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    u = full.usage
    assert u.completion_tokens >= 1 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    texts, finishes, chunks = stream_text(client.chat.completions.create(stream=True, **kw))
    assert texts[0] == choice.message.content
    assert finishes[0] == [choice.finish_reason]  # exactly one finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.id == chunks[0].id for ch in chunks)
    again = client.chat.completions.create(**kw)  # same seed, same text
    assert again.choices[0].message.content == choice.message.content


def test_completions_stream_equals_non_stream_and_echo(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.7, seed=7)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    texts, finishes, _ = stream_text(client.completions.create(stream=True, **kw))
    assert texts[0] == full.choices[0].text
    assert finishes[0] == [full.choices[0].finish_reason]
    echoed = client.completions.create(echo=True, **kw)
    assert echoed.choices[0].text == "Once upon a time" + full.choices[0].text
    texts, _, _ = stream_text(client.completions.create(stream=True, echo=True, **kw))
    assert texts[0] == echoed.choices[0].text


def test_streaming_never_splits_utf8(client):
    # the model continues an emoji run; each emoji is several byte-level tokens, so a stream that
    # cut at token boundaries would show U+FFFD. Only a request cut by max_tokens in the middle of a
    # character may end with one, in its last delta (and then identically when not streamed).
    kw = dict(model=MODEL, prompt="Emoji story: \U0001F642\U0001F642\U0001F436\U0001F431", max_tokens=16,
              temperature=0)
    full = client.completions.create(**kw).choices[0].text
    deltas = [c.text for ch in client.completions.create(stream=True, **kw) for c in ch.choices]
    assert "".join(deltas) == full
    assert any(ord(ch) > 0xFFFF for ch in full)  # it did produce emoji
    assert all("\ufffd" not in d for d in deltas[:-1]), deltas


def test_prompt_forms(client, http):
    ids = http.post("/v1/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    a = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    b = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    c = client.completions.create(model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=6,
                                  temperature=0)
    assert [x.index for x in c.choices] == [0, 1] and c.choices[0].text == a.choices[0].text
    d = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6, temperature=0, n=2)
    assert sorted(x.index for x in d.choices) == [0, 1, 2, 3]
    assert all(x.text == a.choices[0].text for x in d.choices)
    assert d.usage.prompt_tokens == 2 * len(ids)  # each prompt counted once, not once per choice
    assert http.post("/v1/detokenize", json={"tokens": ids}).json()["prompt"] == "The capital of France is"


def test_n2_with_seed(client):
    kw = dict(model=MODEL, messages=chat("Name a colour."), max_tokens=12, temperature=1.0, n=2, seed=99)
    r1 = client.chat.completions.create(**kw)
    r2 = client.chat.completions.create(**kw)
    assert sorted(c.index for c in r1.choices) == [0, 1]
    assert [c.message.content for c in r1.choices] == [c.message.content for c in r2.choices]
    texts, finishes, _ = stream_text(client.chat.completions.create(stream=True, **kw), n=2)
    assert texts == [c.message.content for c in r1.choices]
    assert all(len(f) == 1 for f in finishes.values())
    single = client.chat.completions.create(**{**kw, "n": 1, "seed": 100})  # choice i uses seed + i
    assert single.choices[0].message.content == r1.choices[1].message.content


def test_multi_turn_and_text_parts(client):
    msgs = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "Hi!"}, {"type": "text", "text": "Who are you?"}]},
            {"role": "assistant", "content": "I am a helpful assistant."},
            {"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.content
    assert r.usage.prompt_tokens > 30


def test_logprobs_shapes(client):
    r = client.chat.completions.create(model=MODEL, messages=chat("Say hello."), max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.token == item.top_logprobs[0].token  # greedy: the sampled token is the top one
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
    assert "".join(i.token for i in content) == r.choices[0].message.content or r.choices[0].finish_reason == "stop"
    c = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == c.choices[0].text
    # streamed logprobs cover the same tokens
    toks = []
    for ch in client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=2,
                                        stream=True):
        for cc in ch.choices:
            if cc.logprobs:
                toks += cc.logprobs.tokens
    assert toks == lp.tokens


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=14, temperature=0)
    text = base.choices[0].text
    assert "7" in text, text
    stop = " 7,"
    want = text[:text.index(stop)]
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=14, temperature=0,
                                  stop=[stop, "never-appears"])
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["matched_stop"] == stop
    texts, finishes, chunks = stream_text(client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=14, temperature=0, stop=stop, stream=True))
    assert texts[0] == want and finishes[0] == ["stop"]
    assert not any("7" in (c.text or "") for ch in chunks for c in ch.choices)  # no piece of the stop leaked
    inc = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=14, temperature=0, stop=stop,
                                    extra_body={"include_stop_str_in_output": True})
    assert inc.choices[0].text == want + stop
    # eos / length: matched_stop is the eos id or null
    r = client.chat.completions.create(model=MODEL, messages=chat("Say yes."), max_tokens=30, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(r.choices[0].model_extra["matched_stop"], int)
    r = client.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["matched_stop"] is None


def test_stop_token_ids_and_min_tokens(client, http):
    ids = http.post("/v1/tokenize", json={"prompt": " 7"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5, 6,", max_tokens=10, temperature=0,
                                  extra_body={"stop_token_ids": ids[-1:]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["matched_stop"] == ids[-1]
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=12, temperature=0,
                                  extra_body={"min_tokens": 12, "ignore_eos": False})
    assert r.usage.completion_tokens == 12


def test_include_usage_and_cached_tokens(client):
    system = "You are a meticulous assistant. " + " ".join(f"Rule {i}: be precise and kind." for i in range(40))
    kw = dict(model=MODEL, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(client.chat.completions.create(messages=chat("First question: what is 1+1?", system), **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    first = chunks[-1].usage
    assert first.prompt_tokens > 300
    second = client.chat.completions.create(messages=chat("Second question: what is 2+2?", system),
                                            **{**kw, "stream": False, "stream_options": None})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 300 and cached < second.usage.prompt_tokens


def test_generate_native_and_admin(server, http):
    ids = http.post("/v1/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["output_ids"]) == 5 and out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    pieces = []
    with http.stream("POST", "/generate", json={"text": "The capital of France is", "stream": True,
                                               "sampling_params": {"max_new_tokens": 5, "temperature": 0}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:]))
    assert "".join(p["text"] for p in pieces) == out["text"]
    assert sum(len(p["output_ids"]) for p in pieces) == 5
    assert http.post("/flush_cache").json()["success"] is True
    info = http.get("/server_info").json()
    assert info["kv_slots"] > 0 and info["context_length"] == 8192 and info["dtype"] == "float32"
    m = http.get("/metrics").text
    for name in ("idleless:num_requests_total", "idleless:prompt_tokens_total", "idleless:generation_tokens_total",
                 "idleless:cache_hit_tokens_total", "idleless:cache_hit_rate", "idleless:num_running_reqs",
                 "idleless:num_waiting_reqs", "idleless:kv_usage", "idleless:time_to_first_token_seconds_bucket",
                 "idleless:inter_token_latency_seconds_bucket", "idleless:e2e_request_latency_seconds_bucket",
                 "idleless:num_retractions_total", "idleless:evicted_tokens_total", "idleless:pinned_tokens",
                 "idleless:busy_fraction"):
        assert name in m, name
    # the engine's wall-time buckets are all exposed, and the busy fraction is a fraction
    buckets = {}
    for line in m.splitlines():
        if line.startswith("idleless:engine_time_seconds_total{"):
            buckets[line.split('bucket="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        if line.startswith("idleless:busy_fraction{"):
            busy = float(line.rsplit(" ", 1)[1])
    assert set(buckets) == {"forward", "verify", "draft", "schedule", "kv_transfer", "io", "idle_no_work", "other"}
    assert buckets["forward"] > 0 and buckets["idle_no_work"] > 0 and 0.0 < busy <= 1.0


# ------------------------------------------------------------------------------------------------
# Bad input: 400 with the OpenAI error object, and the server keeps serving
# ------------------------------------------------------------------------------------------------
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
BAD = [
    ("/v1/chat/completions", b'{"model": "x", "messages": [', None, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", None, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     "temperature", None),
    ("/v1/chat/completions", {"model": MODEL}, "messages", None),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, None),
    ("/v1/chat/completions", {**CHAT, "messages": "hello"}, "messages", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": []}]}, None, None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
     None, None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "content": None, "tool_calls": []}]}, None, None),
    # strict types, as OpenAI: "5", "2" and "yes" are refused, not converted (breaker of 2adbfbd)
    ("/v1/completions", {**COMP, "max_tokens": "5"}, "max_tokens", None),
    ("/v1/completions", {**COMP, "n": "2"}, "n", None),
    ("/v1/completions", {**COMP, "stream": "yes"}, "stream", None),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature", None),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature", None),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p", None),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p", None),
    ("/v1/chat/completions", {**CHAT, "top_k": -5}, "top_k", None),
    ("/v1/chat/completions", {**CHAT, "min_p": 2}, "min_p", None),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 3}, "frequency_penalty", None),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": -2.5}, "presence_penalty", None),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty", None),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 1e-300}, "repetition_penalty", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 1000000}, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 9000}, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n", None),
    ("/v1/chat/completions", {**CHAT, "n": 1000}, "n", None),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs", None),
    ("/v1/chat/completions", {**CHAT, "stop": ""}, "stop", None),
    ("/v1/chat/completions", {**CHAT, "stop": [1, 2]}, None, None),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [10**9]}, "stop_token_ids", None),
    ("/v1/chat/completions", {**CHAT, "seed": 2**70}, "seed", None),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 5}, "min_tokens", None),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"999999": 5}}, "logit_bias", None),
    ("/v1/completions", {**COMP, "prompt": ""}, "prompt", None),
    ("/v1/completions", {**COMP, "prompt": []}, "prompt", None),
    ("/v1/completions", {**COMP, "prompt": [[]]}, "prompt", None),
    ("/v1/completions", {**COMP, "prompt": [1, 99999999]}, "prompt", None),
    ("/v1/completions", {**COMP, "prompt": [-1]}, "prompt", None),
    ("/v1/completions", {**COMP, "prompt": [1, "a"]}, "prompt", None),
    # token ids are strict ints: no lax coercion of true, 1.0 or "5" (found by the fresh-clone pass)
    ("/v1/completions", {**COMP, "prompt": [True, 2]}, None, None),
    ("/v1/completions", {**COMP, "prompt": [1.0, 2]}, None, None),
    ("/v1/completions", {**COMP, "prompt": [[1, 2], ["3"]]}, None, None),
    ("/generate", {"input_ids": [True, 2]}, None, None),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [True]}, None, None),
    ("/v1/completions", {**COMP, "prompt": [5] * 9000}, "prompt", "context_length_exceeded"),
    ("/v1/completions", {**COMP, "max_tokens": 8192}, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {**COMP, "prompt": "hello " * 400_000}, "prompt", "context_length_exceeded"),
    ("/v1/completions", {**COMP, "prompt": "hello " * 20_000}, "prompt", "context_length_exceeded"),
    ("/v1/completions", {**COMP, "logprobs": 30}, "logprobs", None),
    ("/v1/completions", {**COMP, "max_tokens": 1.5}, "max_tokens", None),
    ("/v1/completions", {**COMP, "n": "two"}, "n", None),
    ("/generate", {"sampling_params": {}}, None, None),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, None, None),
    ("/generate", {"input_ids": [10**9]}, None, None),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": "x"}}, None, None),
    ("/v1/detokenize", {"tokens": [-3]}, None, None),
]


@pytest.mark.parametrize("path,body,param,code", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_is_400(server, http, path, body, param, code):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_model_is_404(server, http):
    """As OpenAI and vLLM: a model that is not served is a 404 ``model_not_found`` naming ``model``."""
    for path, body in (("/v1/chat/completions", {**CHAT, "model": "gpt-17"}), ("/v1/completions", {**COMP, "model": "x"})):
        r = http.post(path, json=body)
        assert r.status_code == 404, (r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == "model" and err["code"] == "model_not_found" and set(err) == {"message", "type", "param",
                                                                                            "code"}
    assert httpx.get(server.url + "/health").status_code == 200


def test_stream_options_without_stream_is_400(http):
    """As OpenAI: ``stream_options`` is only allowed with ``stream`` (it is not silently ignored)."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stream_options": {"include_usage": True}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == "stream_options"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "\\udfff", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "ab\\ud800"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages"),
    ("/generate", '{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "text"),
    ("/v1/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogate_is_400_and_the_connection_stays_usable(server, path, body, param):
    """JSON may escape a lone UTF-16 surrogate ("\\udfff"), which has no UTF-8 form: a 400 naming the
    field (for chat, the message), not a 500 from the tokenizer, and the keep-alive connection serves on."""
    with httpx.Client(base_url=server.url, headers={**server.headers, "Content-Type": "application/json"},
                      timeout=60) as c:
        r = c.post(path, content=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and "surrogate" in err["message"]
        if param == "messages":  # names the message, not a position in the rendered template
            assert err["message"].startswith("messages[0].content")
        ok = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})  # same connection, still served
        assert ok.status_code == 200, ok.text


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_tiny_temperature_is_greedy(client):
    # 1e-300 / 1e-259 underflow float32 in the sampler (inf/NaN probabilities); the server treats
    # any temperature below 1e-5 as greedy instead of failing the engine step
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=4)
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    assert client.completions.create(temperature=1e-259, **kw).choices[0].text == greedy


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=10**6)
    assert ei.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    # and still serving
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None


# ------------------------------------------------------------------------------------------------
# Disconnects
# ------------------------------------------------------------------------------------------------
def test_disconnect_mid_stream_releases_kv(server, http):
    server.wait_idle_kv()
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 4000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as s:
            got = 0
            for line in s.iter_lines():
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break
        assert server.stats()["kv"]["total"] > 0
    server.wait_idle_kv(timeout=30)
    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=httpx.Timeout(60, read=1.5),
                   json={**body, "stream": False})
    s = server.wait_idle_kv(timeout=30)
    assert s["kv"]["free"] + s["kv"]["cached"] == s["kv"]["total"]
    assert httpx.get(server.url + "/health").status_code == 200


# ------------------------------------------------------------------------------------------------
# Concurrency: 32 streaming clients == the offline Engine
# ------------------------------------------------------------------------------------------------
def test_32_concurrent_streams_match_offline_engine(server, smollm2_dir):
    from idleless.engine.engine import Engine
    from idleless.engine.request import SamplingParams

    topics = ["the moon", "bread", "rivers", "chess", "volcanoes", "owls", "trains", "jazz", "glaciers",
              "bees", "maps", "tea", "clocks", "deserts", "kites", "whales"]
    prompts = [chat(f"Write two sentences about {t}.") for t in topics] + \
              [chat(f"Give me a short tip about {t}.", "You are terse.") for t in topics]
    specs = [dict(temperature=0.0) for _ in range(24)] + [dict(temperature=0.8, seed=1000 + i) for i in range(8)]
    max_tokens = 20

    async def one(ac, msgs, spec):
        stream = await ac.chat.completions.create(model=MODEL, messages=msgs, max_tokens=max_tokens, stream=True,
                                                  **spec)
        text, finishes = "", []
        async for ch in stream:
            for c in ch.choices:
                text += c.delta.content or ""
                if c.finish_reason:
                    finishes.append(c.finish_reason)
        return text, finishes

    async def run_all():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(ac, m, s) for m, s in zip(prompts, specs)))
        finally:
            await ac.close()

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    served = time.monotonic() - t0
    assert all(len(f) == 1 for _, f in results)

    engine = Engine(dtype="float32", kv_cache_memory="256MiB", num_threads=1)
    params = [SamplingParams(max_new_tokens=max_tokens, temperature=s["temperature"], seed=s.get("seed"))
              for s in specs]
    offline = engine.generate(prompts, params, use_tqdm=False)
    mismatches = [(i, r[0], o.text) for i, (r, o) in enumerate(zip(results, offline)) if r[0] != o.text]
    assert not mismatches, mismatches
    assert [r[1][0] for r in results] == [o.finish_reason for o in offline]
    print(f"32 streams served in {served:.1f} s")
