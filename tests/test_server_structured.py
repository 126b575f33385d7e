"""Structured outputs through a real server (the bundled SmolLM2): OpenAI's ``response_format`` (also
via the openai SDK's ``parse`` with a pydantic model), vLLM's ``structured_outputs`` / ``guided_*``,
SGLang's ``regex`` / ``ebnf`` / ``json_schema`` in /generate; every constrained output parses and
validates (jsonschema), with n=4, streaming and seeds; malformed constraints are 400s in the OpenAI
error shape and the server keeps serving."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.timeout(900)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Lima", "Oslo"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, an age and a city."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)


def _person(text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, PERSON)
    return obj


def test_chat_json_schema_n4_seeded(http):
    body = {"messages": ASK, "max_tokens": 60, "n": 4, "temperature": 1.0, "seed": 11,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                      "strict": True}}}
    # the same seed gives the same answers from the same cache state: without
    # --enable-deterministic-inference a prompt served from the radix cache is summed in another order
    # (README, "Deterministic inference"), which can move a temperature-1 draw; so both calls start cold
    assert http.post("/flush_cache").status_code == 200
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4
    for c in choices:
        _person(c["message"]["content"])
        assert c["finish_reason"] == "stop"
    assert http.post("/flush_cache").status_code == 200
    again = http.post("/v1/chat/completions", json=body).json()["choices"]
    assert [c["message"]["content"] for c in again] == [c["message"]["content"] for c in choices]


def test_chat_json_object_streamed(http):
    body = {"messages": ASK, "max_tokens": 80, "stream": True, "temperature": 0,
            "response_format": {"type": "json_object"}, "logprobs": True}
    text, reasons, lps = "", [], 0
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"][0]
                text += ch["delta"].get("content") or ""
                reasons.append(ch["finish_reason"])
                lps += len((ch.get("logprobs") or {}).get("content") or [])
    full = http.post("/v1/chat/completions", json={**body, "stream": False}).json()["choices"][0]
    assert text == full["message"]["content"] and reasons[-1] == full["finish_reason"]
    if full["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    assert lps > 0


class City(BaseModel):
    name: str
    country: str
    population_millions: int


def test_openai_sdk_parse_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Name a big city."}], response_format=City,
              max_tokens=80, temperature=0)
    msg = r.choices[0].message
    if r.choices[0].finish_reason == "stop":
        assert isinstance(msg.parsed, City)
        assert City.model_validate_json(msg.content) == msg.parsed


@pytest.mark.parametrize("field, value, check", [
    ("guided_regex", r"[A-Z][a-z]{2,6} \d{2}", lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} \d{2}", t)),
    ("guided_choice", ["red", "green", "blue"], lambda t: t in ("red", "green", "blue")),
    ("guided_json", PERSON, _person),
    ("guided_grammar", 'root ::= ("yes" | "no") "!"', lambda t: t in ("yes!", "no!")),
    ("regex", r"\d{3}-\d{4}", lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
    ("ebnf", 'root ::= "a" [b-d] [b-d]? "e"', lambda t: re.fullmatch("a[b-d]{1,2}e", t)),
])
def test_completions_vllm_and_sglang_fields(http, field, value, check):
    r = http.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 60, "temperature": 0.7, "seed": 3,
                                           "n": 2, field: value})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop", c
        assert check(c["text"]), c["text"]


@pytest.mark.parametrize("key, value, check", [
    ("json", PERSON, _person), ("regex", r"(ab){1,3}c", lambda t: re.fullmatch("(ab){1,3}c", t)),
    ("choice", ["left", "right"], lambda t: t in ("left", "right")),
    ("grammar", 'root ::= [0-9] "+" [0-9]', lambda t: re.fullmatch(r"\d\+\d", t)),
])
def test_chat_structured_outputs_field(http, key, value, check):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 60, "temperature": 0,
                                                "structured_outputs": {key: value}})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and check(c["message"]["content"]), c


@pytest.mark.parametrize("key, value, check", [
    ("regex", r"[a-z]{1,8}@[a-z]{1,8}\.com", lambda t: re.fullmatch(r"[a-z]{1,8}@[a-z]{1,8}\.com", t)),
    ("ebnf", 'root ::= "x" | "y"', lambda t: t in ("x", "y")),
    ("json_schema", json.dumps(PERSON), _person),
])
def test_generate_sglang_constraints(http, key, value, check):
    r = http.post("/generate", json={"text": "Output:", "sampling_params": {"max_new_tokens": 60, "temperature": 0,
                                                                           key: value}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop" and check(out["text"]), out


def test_constrained_beside_free_requests(http):
    """Free requests sent together with constrained ones get the output they get alone (greedy)."""
    free = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in ("The sky is", "Once upon a time", "2+2=")]
    alone = [http.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in free]
    constrained = [{"prompt": "Answer:", "max_tokens": 40, "temperature": 0, "guided_json": PERSON},
                   {"prompt": "Answer:", "max_tokens": 40, "temperature": 0, "guided_regex": "[a-z]{5,9}"}]
    with ThreadPoolExecutor(5) as ex:
        futs = [ex.submit(http.post, "/v1/completions", json=b) for b in constrained + free]
        outs = [f.result().json()["choices"][0]["text"] for f in futs]
    assert outs[2:] == alone
    _person(outs[0])
    assert re.fullmatch("[a-z]{5,9}", outs[1])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wrong"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[a-"}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= missing"}, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_decoding_backend": "outlines"},
     "guided_decoding_backend"),
    ("/v1/chat/completions", {"messages": ASK, "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= ("}}, "sampling_params.ebnf"),
])
def test_malformed_constraints_are_400s(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
