"""Tool-call parsers (hermes, smollm2, llama3_json) on hand-written replies, the schemas that force
calls, and the streamed deltas: content before a call, then per call its header and argument pieces
that concatenate to the call's JSON — for every way of cutting the reply into pieces."""

from __future__ import annotations

import json
import re

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


def _tokens(text):
    """A scripted token stream: words, runs of spaces and single punctuation marks, as a BPE tokenizer
    would cut JSON (no model needed)."""
    return re.findall(r"\s+|\w+|[^\w\s]", text)


def _incremental(plan, pieces):
    """Feeds ``pieces`` one by one; per call (index) its header delta and the argument pieces, each
    with the number of pieces fed when it came out."""
    ts = ToolStream(plan)
    content, calls = "", {}
    for i, p in enumerate(pieces):
        c, deltas = ts.feed(p, i == len(pieces) - 1)
        content += c
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function" and d.function.arguments == ""
                calls[d.index] = {"name": d.function.name, "id": d.id, "pieces": []}
            else:
                assert d.function.name is None and d.id is None and d.function.arguments
                calls[d.index]["pieces"].append((i, d.function.arguments))
    return content, calls, ts.finish_reason("stop")


ARGS = '{"city": "Oslo", "unit": "celsius", "days": [1, 2], "note": "a } and a \\" inside"}'
STREAMED = [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS + '}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'),
    ("smollm2", '<tool_call>[\n{"name": "get_weather", "arguments": ' + ARGS + '},\n{"name": "get_time", '
     '"arguments": {"tz": "UTC"}}\n]</tool_call>'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": ' + ARGS + '}; {"name": "get_time", '
     '"parameters": {"tz": "UTC"}}'),
    ("required", '[{"name": "get_weather", "parameters": ' + ARGS + '}, {"name": "get_time", "parameters": '
     '{"tz": "UTC"}}]'),
]


def _plan(name, parallel=True):
    if name == "required":
        return ToolPlan("required")
    return ToolPlan("auto", parser=make_parser(name), parallel=parallel)


@pytest.mark.parametrize("name, text", STREAMED, ids=[n for n, _ in STREAMED])
def test_arguments_stream_in_pieces_as_written(name, text):
    pieces = _tokens(text) + [""]
    assert "".join(pieces) == text
    plan = _plan(name)
    content, calls, reason = _incremental(plan, pieces)
    want_content, want, want_reason = plan.reply(text, "stop")
    assert reason == want_reason == "tool_calls" and content.strip() == (want_content or "")
    assert [c["name"] for c in calls.values()] == [c.function.name for c in want] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls.values()}) == 2
    for got, w in zip(calls.values(), want):
        args = "".join(p for _, p in got["pieces"])
        assert args == w.function.arguments and json.loads(args) is not None
    # the first call's arguments went out token by token, all of them before the text after them
    first = calls[0]["pieces"]
    assert len(first) == len(_tokens(ARGS))
    end_of_args = len(_tokens(text[:text.index(ARGS) + len(ARGS)]))
    assert first[-1][0] == end_of_args - 1 and "".join(p for _, p in first) == ARGS


@pytest.mark.parametrize("name, text", STREAMED, ids=[n for n, _ in STREAMED])
@pytest.mark.parametrize("cut", [1, 3, 8])
def test_streamed_calls_equal_the_whole_reply_for_any_cut(name, text, cut):
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)] + [""]
    plan = _plan(name)
    _, calls, _ = _incremental(plan, pieces)
    _, want, _ = plan.reply(text, "stop")
    assert [(c["name"], "".join(p for _, p in c["pieces"])) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in want]


def test_a_call_in_another_key_order_goes_out_whole_at_the_end():
    text = '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>'
    plan = _plan("hermes")
    _, calls, reason = _incremental(plan, _tokens(text) + [""])
    (call,) = calls.values()
    assert {i for i, _ in call["pieces"]} == {len(_tokens(text))}  # all with the final piece
    assert "".join(p for _, p in call["pieces"]) == plan.reply(text, "stop")[1][0].function.arguments
    assert reason == "tool_calls"


def test_without_parallel_calls_only_the_first_streams():
    plan = _plan("smollm2", parallel=False)
    text = STREAMED[1][1]
    _, calls, _ = _incremental(plan, _tokens(text) + [""])
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert "".join(p for _, p in calls[0]["pieces"]) == ARGS


@pytest.mark.parametrize("name, text", [
    ("hermes", "Plain text, a <tag> and a { brace."),
    ("llama3_json", 'The answer is {"a": 1}.'),
    ("llama3_json", '{"answer": 42}'),
    ("smollm2", '<tool_call>not json</tool_call> after'),
])
def test_text_without_a_call_streams_as_content(name, text):
    content, calls, reason = _incremental(_plan(name), _tokens(text) + [""])
    assert content == text and calls == {} and reason == "stop"


def test_a_reply_cut_inside_a_call_keeps_what_was_sent():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Os'
    content, calls, _ = _incremental(_plan("hermes"), _tokens(text) + [""])
    assert content == "" and calls[0]["name"] == "get_weather"
    assert "".join(p for _, p in calls[0]["pieces"]) == '{"city": "Os'
