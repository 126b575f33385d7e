"""Tool calls through a real server (the bundled SmolLM2 with ``--tool-call-parser smollm2``): the
openai SDK's two-turn tool loop (a forced call, the tool's result in the history, the answer),
``required`` and named functions whose arguments always parse and match the schema (also with n=2 and
streamed as OpenAI's deltas: the arguments in several pieces that concatenate to the non-streamed
reply's), ``auto`` read by the parser (streamed: the same content and calls), ``none``, and bad tool
specs as 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server_harness import MAIN_API_KEY, MAIN_ARGS, shared_server

pytestmark = pytest.mark.timeout(900)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir, pytestconfig):
    return shared_server(pytestconfig, MAIN_ARGS + ("--tool-call-parser", "smollm2"), MAIN_API_KEY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _check_weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


def test_two_turn_tool_loop_with_the_sdk(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=80, temperature=0, parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        _check_weather_args(call.function.arguments)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    second = client.chat.completions.create(model=model, messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                            max_tokens=30, temperature=0)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_named_function_n2_seeded(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], n=2, seed=5, temperature=1.0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=60)
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        _check_weather_args(call.function.arguments)


def _streamed(stream):
    """(content, calls, finish reasons) of a streamed chat reply; a call is {"name", "id", "pieces"}:
    its header delta once (index, id, type, name), then its argument pieces."""
    content, calls, reasons = "", {}, []
    for chunk in stream:
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index == len(calls) and d.type == "function" and d.function.name
                    assert d.function.arguments == ""
                    calls[d.index] = {"name": d.function.name, "id": d.id, "pieces": []}
                else:
                    assert d.function.name is None and d.function.arguments
                    calls[d.index]["pieces"].append(d.function.arguments)
    return content, calls, reasons


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas(client, model, tool_choice):
    kw = dict(model=model, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, reasons = _streamed(client.chat.completions.create(**kw, stream=True))
    assert reasons[-1] == whole.finish_reason == "tool_calls" and list(calls) == [0] and not content
    (want,) = whole.message.tool_calls
    assert calls[0]["name"] == want.function.name == "get_weather"
    assert len(calls[0]["pieces"]) > 1  # the arguments went out as the model wrote them, not at the end
    assert "".join(calls[0]["pieces"]) == want.function.arguments
    _check_weather_args(want.function.arguments)


def test_streamed_auto_equals_the_whole_reply(client, model):
    kw = dict(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, reasons = _streamed(client.chat.completions.create(**kw, stream=True))
    assert reasons[-1] == whole.finish_reason
    want = whole.message.tool_calls or []
    assert [(c["name"], "".join(c["pieces"])) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in want]
    assert content.strip() == (whole.message.content or "").strip()


def test_auto_is_read_by_the_parser(http):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 60,
                                                "temperature": 0})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    for call in c["message"]["tool_calls"]:
        assert call["function"]["name"] and json.loads(call["function"]["arguments"]) is not None
    assert (c["finish_reason"] == "tool_calls") == bool(c["message"]["tool_calls"])
    assert "<tool_call>" not in (c["message"]["content"] or "") or not c["message"]["tool_calls"]


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wrong"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "18 C"}]}, "messages[2].tool_call_id"),
])
def test_bad_tool_specs_are_400s(http, body, param):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body})  # body may replace messages
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}).status_code == 200


def test_auto_needs_a_parser_on_the_default_server(pytestconfig, smollm2_dir):
    import httpx
    srv = shared_server(pytestconfig)
    r = httpx.post(srv.url + "/v1/chat/completions", headers=srv.headers, timeout=120,
                   json={"messages": ASK, "tools": [WEATHER], "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
