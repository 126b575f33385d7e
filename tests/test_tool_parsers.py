"""Tool-call parsers (hermes, smollm2, llama3_json) on hand-written replies, the schemas that force
calls, and the streamed deltas: content before a call, then per call its header and argument pieces
that concatenate to the call's JSON — for every way of cutting the reply into pieces."""

from __future__ import annotations

import json

import jsonschema
import pytest

from idleless.server.chat_tools import ToolPlan, ToolStream
from idleless.server.tool_calls import (SMOLLM2_TOOLS_TEMPLATE, calls_of_required, make_parser, named_schema,
                                        required_schema)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo"})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": '
     '{"x": 1}}</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("smollm2", '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Lima"}},\n{"name": "get_time", '
     '"arguments": {}}\n]</tool_call>', "", [("get_weather", {"city": "Lima"}), ("get_time", {})]),
    ("smollm2", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "", [("get_time", {})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": 2}}', "",
     [("a", {}), ("b", {"y": 2})]),
    ("llama3_json", "The answer is {1}.", "The answer is {1}.", []),
])
def test_parsers(name, text, content, calls):
    got_content, got = make_parser(name).parse(text)
    assert got_content == content and _calls(got) == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


def test_unknown_parser():
    with pytest.raises(ValueError):
        make_parser("nope")


def test_required_schema_accepts_calls_and_refuses_others():
    s = required_schema([WEATHER, TIME], parallel=True)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, s)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, s)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, required_schema([WEATHER, TIME], parallel=False))
    assert _calls(calls_of_required(json.dumps(good))) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert named_schema(TIME) == {"type": "object", "properties": {}}


def _stream(plan, pieces):
    ts = ToolStream(plan)
    content, deltas = "", []
    for i, p in enumerate(pieces):
        c, d = ts.feed(p, i == len(pieces) - 1)
        content += c
        deltas += d
    return content, deltas, ts.finish_reason("stop")


def _assemble(deltas):
    calls = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls and d.type == "function" and d.function.name
            calls[d.index] = [d.function.name, ""]
        calls[d.index][1] += d.function.arguments or ""
    return [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]


REPLY = 'Sure.\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11, len(REPLY)])
def test_stream_auto_any_cut(cut):
    pieces = [REPLY[i:i + cut] for i in range(0, len(REPLY), cut)] + [""]
    content, deltas, reason = _stream(ToolPlan("auto", parser=make_parser("smollm2")), pieces)
    assert content.strip() == "Sure." and "<tool" not in content
    assert _assemble(deltas) == [("get_weather", {"city": "Oslo"})] and reason == "tool_calls"


def test_stream_auto_without_a_call_is_all_content():
    text = "I cannot help < with that <tool"
    content, deltas, reason = _stream(ToolPlan("auto", parser=make_parser("hermes")), list(text) + [""])
    assert content == text and deltas == [] and reason == "stop"


def test_stream_named_and_required():
    content, deltas, reason = _stream(ToolPlan("named", name="get_weather"), ['{"ci', 'ty": "Rom', 'e"}', ""])
    assert content == "" and _assemble(deltas) == [("get_weather", {"city": "Rome"})] and reason == "tool_calls"
    body = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    content, deltas, reason = _stream(ToolPlan("required"), [body[:9], body[9:], ""])
    assert content == "" and _assemble(deltas) == [("get_time", {}), ("get_weather", {"city": "Oslo"})]


def test_smollm2_tools_template_renders_tools_calls_and_results():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v: json.dumps(v)
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "12 C", "tool_call_id": "c1"}]
    text = env.from_string(SMOLLM2_TOOLS_TEMPLATE).render(messages=msgs, tools=[WEATHER], add_generation_prompt=True)
    assert '<tools>[{"name": "get_weather"' in text
    assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call><|im_end|>' in text
    assert "<tool_response>\n12 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    plain = env.from_string(SMOLLM2_TOOLS_TEMPLATE).render(messages=msgs[:1], tools=None, add_generation_prompt=True)
    assert plain.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_auto_without_parallel_calls_keeps_the_first():
    text = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]</tool_call>'
    plan = ToolPlan("auto", parser=make_parser("smollm2"), parallel=False)
    content, calls, reason = plan.reply(text, "stop")
    assert [c.function.name for c in calls] == ["a"] and reason == "tool_calls"
    _, deltas, _ = _stream(plan, [text, ""])
    assert _assemble(deltas) == [("a", {})]
