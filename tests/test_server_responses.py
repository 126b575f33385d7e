"""The Responses API (POST /v1/responses) through a real server, driven by the openai SDK: text and
message input with instructions, max_output_tokens (incomplete), text.format JSON schemas (also the
SDK's parse with a pydantic model), function tools with a forced call and a two-turn loop of
function_call / function_call_output items, and streaming with the typed events."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from server_harness import MAIN_API_KEY, MAIN_ARGS, shared_server

pytestmark = pytest.mark.timeout(900)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(smollm2_dir, pytestconfig):
    return shared_server(pytestconfig, MAIN_ARGS + ("--tool-call-parser", "smollm2"), MAIN_API_KEY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_text_input_and_instructions(client, model, http):
    r = client.responses.create(model=model, input="Say hello.", instructions="Answer briefly.",
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text and r.usage.output_tokens == 8 and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hello."}],
        "max_tokens": 8, "temperature": 0}).json()
    assert r.output_text == chat["choices"][0]["message"]["content"]


def test_json_schema_format(client, model):
    r = client.responses.create(model=model, input=[{"role": "user", "content": "Describe a person."}],
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                 "strict": True}}, max_output_tokens=60, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)


class Person(BaseModel):
    name: str
    age: int


def test_sdk_parse(client, model):
    r = client.responses.parse(model=model, input="Describe a person.", text_format=Person, max_output_tokens=60,
                               temperature=0)
    if r.status == "completed":
        assert isinstance(r.output_parsed, Person)


def test_tool_loop(client, model):
    first = client.responses.create(model=model, input="What is the weather in Oslo?", tools=[WEATHER],
                                    tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    second = client.responses.create(model=model, tools=[WEATHER], tool_choice="none", max_output_tokens=20,
                                     temperature=0, input=[
                                         {"role": "user", "content": "What is the weather in Oslo?"},
                                         {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                                          "arguments": calls[0].arguments},
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "12 C, rain"}])
    assert second.output_text and not [o for o in second.output if o.type == "function_call"]


def test_streaming_events(client, model):
    kw = dict(model=model, input="Count to five.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
              "response.content_part.done", "response.output_item.done"):
        assert k in kinds


def test_streamed_function_call(client, model):
    events = list(client.responses.create(model=model, input="Weather in Rome?", tools=[WEATHER], stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=60, temperature=0))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == args
    jsonschema.validate(json.loads(args), WEATHER["parameters"])
    final = events[-1].response
    assert [o.type for o in final.output] == ["function_call"] and final.output[0].arguments == args


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": []}, "input"),  # named as the Responses API's field, not the chat request it becomes
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
])
def test_bad_requests(http, body, param):
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
