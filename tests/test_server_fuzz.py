"""Property-based fuzzing of request bodies against a real server (hypothesis): whatever the body,
the answer is never a 5xx, errors are OpenAI error objects, streams end with ``data: [DONE]``, and
the server stays healthy. Bounded: a fixed number of examples per endpoint, small max_tokens."""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


pytestmark = pytest.mark.timeout(600)
MODEL = "SmolLM2-135M-Instruct"
EXAMPLES = int(os.environ.get("IDLELESS_FUZZ_EXAMPLES", "40"))  # per test; raise it for a longer hunt


leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=12))
junk = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=8)
# valid max_tokens stay small so that no example runs long; the rest are wrong in every way
max_tokens = st.integers(1, 6) | st.sampled_from([0, -1, 8192, 10**9, 2**64, 1.5, "4", True, [], {}, math.nan])
number = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5) | st.sampled_from([0.0, 1.0, 0.5])
small_int = st.integers(-3, 20) | st.sampled_from([10**12, -(2**70)])
text = st.text(max_size=30)
token_ids = st.lists(st.integers(-3, 49200), max_size=12)
stop = st.none() | text | st.lists(text, max_size=4) | junk

optional_fields = {
    "model": st.sampled_from([MODEL, "other-model", None]) | junk,
    "temperature": number, "top_p": number, "top_k": small_int, "min_p": number,
    "frequency_penalty": number, "presence_penalty": number, "repetition_penalty": number,
    "seed": st.integers(-(2**65), 2**65) | junk, "stop": stop, "stop_token_ids": token_ids | junk,
    "ignore_eos": st.booleans() | junk, "min_tokens": small_int, "n": small_int | junk,
    "stream": st.booleans(), "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}) | junk,
    "logit_bias": st.none() | junk, "user": text | junk, "response_format": st.none() | junk,
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans() | junk,
}

part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | junk, "text": text | junk})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot"]) | junk},
    optional={"content": text | st.lists(part, max_size=2) | st.none() | junk, "name": text | junk})
chat_body = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=3) | junk, "max_tokens": max_tokens},
    optional={**optional_fields, "logprobs": st.booleans() | junk, "top_logprobs": small_int | junk,
              "max_completion_tokens": max_tokens})
prompt = text | token_ids | st.lists(text, max_size=3) | st.lists(token_ids, max_size=3) | junk
completion_body = st.fixed_dictionaries(
    {"prompt": prompt, "max_tokens": max_tokens},
    optional={**optional_fields, "echo": st.booleans() | junk, "logprobs": small_int | junk | st.none()})
generate_body = st.fixed_dictionaries(
    {"sampling_params": st.fixed_dictionaries(
                      {"max_new_tokens": max_tokens},
                      optional={"temperature": number, "top_k": small_int, "stop": stop, "n": small_int,
                                "seed": small_int, "logprobs": st.booleans(), "bogus": junk})},
    optional={"input_ids": token_ids | junk, "text": text | junk, "stream": st.booleans()})


def check(http: httpx.Client, path: str, body, expect_ok: bool = False) -> None:
    """Send ``body``; never a 5xx; errors are OpenAI error objects; a 200 stream ends with [DONE]
    and gives each choice exactly one finish_reason. ``expect_ok``: the body is valid, so 200."""
    raw = json.dumps(body)  # NaN / Infinity go out as the (non-standard) literals Python's json reads back
    stream = isinstance(body, dict) and body.get("stream") is True
    with http.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as r:
        data = r.read().decode("utf-8", errors="replace")
    assert r.status_code < 500, (r.status_code, data[:2000], raw[:2000])
    if expect_ok:
        assert r.status_code == 200, (data[:2000], raw[:2000])
    if r.status_code != 200:
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return
    if path == "/generate":
        return
    n = body.get("n") or 1
    prompts = body.get("prompt")
    count = n * (len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)) else 1)
    if stream:
        assert data.rstrip().endswith("data: [DONE]"), data[-500:]
        assert '"error"' not in data, data[:2000]
        finishes: dict[int, int] = {}
        for line in data.splitlines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    if c["finish_reason"] is not None:
                        finishes[c["index"]] = finishes.get(c["index"], 0) + 1
        assert finishes == {i: 1 for i in range(count)}, finishes
    else:
        out = json.loads(data)
        assert sorted(c["index"] for c in out["choices"]) == list(range(count))
        assert all(c["finish_reason"] in ("stop", "length") for c in out["choices"])


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
VALID_SETTINGS = settings(SETTINGS, max_examples=max(1, EXAMPLES * 3 // 5))  # these run the model

# -- valid bodies: must be answered 200 -----------------------------------------------------------
valid_sampling = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.sampled_from([-1, 0, 1, 5, 50]),
    "min_p": st.floats(0, 1), "frequency_penalty": st.floats(-2, 2), "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "seed": st.integers(0, 2**32),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3), "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1), "n": st.integers(1, 3),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(), "model": st.just(MODEL),
}
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]),
     "content": st.text(max_size=40) | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                      "text": st.text(max_size=20)}), min_size=1,
                                                       max_size=2)})  # [] is a 400, as OpenAI


@st.composite
def with_stream(draw, body):
    """``body`` plus an optional ``stream``; ``stream_options`` only with ``stream: true`` (OpenAI and vLLM
    answer 400 to stream_options on a non-streaming request)."""
    stream = draw(st.sampled_from([None, False, True]))
    if stream is not None:
        body["stream"] = stream
    if stream and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


@st.composite
def valid_chat(draw):
    body = draw(st.fixed_dictionaries({"messages": st.lists(valid_message, min_size=1, max_size=3),
                                       "max_tokens": st.integers(1, 3)}, optional=valid_sampling))
    if draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 5))
    return draw(with_stream(body))


@st.composite
def valid_completion(draw):
    prompt = draw(st.text(min_size=1, max_size=40).filter(lambda t: t.strip() != "" or t == " ")
                  | st.lists(st.integers(0, 49151), min_size=1, max_size=20)
                  | st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=2))
    body = draw(st.fixed_dictionaries({"prompt": st.just(prompt), "max_tokens": st.integers(1, 3)},
                                      optional={**valid_sampling, "logprobs": st.integers(0, 5)}))
    if "logprobs" not in body and draw(st.booleans()):
        body["echo"] = True
    return draw(with_stream(body))


@st.composite
def mutated(draw, valid, fields):
    """A valid body with one field replaced by junk (or removed)."""
    body = dict(draw(valid))
    key = draw(st.sampled_from(sorted(fields)))
    if draw(st.integers(0, 4)) == 0:
        body.pop(key, None)
    else:
        body[key] = draw(junk | leaf)
    if body.get("max_tokens") is None or (isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 6):
        body["max_tokens"] = draw(max_tokens)  # keep every example short
    return body


@VALID_SETTINGS
@given(body=valid_chat())
def test_fuzz_valid_chat(http, body):
    check(http, "/v1/chat/completions", body, expect_ok=True)


@VALID_SETTINGS
@given(body=valid_completion())
def test_fuzz_valid_completions(http, body):
    check(http, "/v1/completions", body, expect_ok=True)


# -- anything: never a 5xx -----------------------------------------------------------------------
@SETTINGS
@given(body=chat_body | junk | mutated(valid_chat(), set(valid_sampling) | {"messages", "logprobs", "top_logprobs"}))
def test_fuzz_chat(http, body):
    check(http, "/v1/chat/completions", body)


@SETTINGS
@given(body=completion_body | junk | mutated(valid_completion(), set(valid_sampling) | {"prompt", "echo", "logprobs"}))
def test_fuzz_completions(http, body):
    check(http, "/v1/completions", body)


@SETTINGS
@given(body=generate_body | junk)
def test_fuzz_generate(http, body):
    check(http, "/generate", body)


def test_healthy_after_fuzzing(server, http):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    server.wait_idle_kv()
