"""Streamed chunks written without pydantic (routes_openai.PlainChunks) against the pydantic chunk
models (the reference): the same bytes, for text with quotes, escapes, control characters and
non-ASCII, every finish reason and matched stop type, several choices, the chat role chunk; the rare
shapes (usage, tool calls) still go through the models."""

import itertools
import json
from types import SimpleNamespace

import pytest

from idleless.server.asgi import sse
from idleless.server.chat_tools import ToolPlan
from idleless.server.protocol import (ChatCompletionChunk, ChatStreamChoice, CompletionChunk, CompletionStreamChoice,
                                      DeltaMessage, PromptTokensDetails, UsageInfo)
from idleless.server.routes_openai import ChatStream, CompletionStream
from idleless.text.output import CompletionDelta

TEXTS = ["", "hello", " world", 'say "hi"', "back\\slash", "two\nlines\r\n", "tab\there", "\x00\x01\x08\x0c\x1f\x7f",
         "é中文🙂", "\u2028\u2029", "</script>", "a/b", "\ufeff", "{\"json\": [1]}"]
FINISH = [None, "stop", "length", "abort"]
MATCHED = [None, 2, "</s>", 'q"\n']
IDS = [("chatcmpl-abc", "replay", "fp_1"), ('id"é', 'my "model"/ü\n', None)]


def _sub(n_choices: int):
    """A Submission stand-in: what the streams read of it (states' index and usage counts)."""
    states = [SimpleNamespace(index=i, prompt_tokens=5, cached_tokens=2, token_ids=[1, 2, 3]) for i in range(n_choices)]
    return SimpleNamespace(states=states)


def _same(fast: str, ref: str) -> None:
    assert fast.startswith("data: ") and fast.endswith("\n\n")
    assert json.loads(fast[6:]) == json.loads(ref[6:])
    assert fast == ref  # pydantic's bytes exactly (field order, escapes, non-ASCII as is)


@pytest.mark.parametrize("rid,model,fp", IDS)
def test_completion_chunks_equal_pydantic(rid, model, fp):
    cs = CompletionStream(None, _sub(4), 4, rid, model, fp, include_usage=False, continuous_usage=False, echo_of=None)
    for text, reason, matched, index in itertools.product(TEXTS, FINISH, MATCHED, (0, 3)):
        got = cs.delta(CompletionDelta(rid="r", index=index, text=text, token_ids=[7], finish_reason=reason,
                                       matched_stop=matched))
        if not text and reason is None:
            assert got is None
            continue
        ref = sse(CompletionChunk(id=rid, created=cs.created, model=model, system_fingerprint=fp,
                                  choices=[CompletionStreamChoice(index=index, text=text, finish_reason=reason,
                                                                  matched_stop=matched)]))
        _same(got, ref)


@pytest.mark.parametrize("rid,model,fp", IDS)
def test_chat_chunks_equal_pydantic(rid, model, fp):
    cs = ChatStream(None, _sub(3), 3, rid, model, fp, include_usage=False, continuous_usage=False)
    opening = list(cs.opening())
    assert len(opening) == 3
    for i, got in enumerate(opening):  # the first chunk of each choice: the assistant role
        _same(got, sse(ChatCompletionChunk(id=rid, created=cs.created, model=model, system_fingerprint=fp,
                                           choices=[ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                                                 content=""))])))
    for text, reason, matched, index in itertools.product(TEXTS, FINISH, MATCHED, (0, 2)):
        got = cs.delta(CompletionDelta(rid="r", index=index, text=text, token_ids=[7], finish_reason=reason,
                                       matched_stop=matched))
        if not text and reason is None:
            assert got is None
            continue
        ref = sse(ChatCompletionChunk(id=rid, created=cs.created, model=model, system_fingerprint=fp,
                                      choices=[ChatStreamChoice(index=index, delta=DeltaMessage(content=text or None),
                                                                finish_reason=reason, matched_stop=matched)]))
        _same(got, ref)


def test_completion_echo_first_chunk():
    cs = CompletionStream(None, _sub(2), 2, "cmpl-1", "m", "fp", include_usage=False, continuous_usage=False,
                          echo_of=lambda i: f"prompt {i}\n")
    got = cs.delta(CompletionDelta(rid="r", index=1, text=" out", token_ids=[7]))
    ref = sse(CompletionChunk(id="cmpl-1", created=cs.created, model="m", system_fingerprint="fp",
                              choices=[CompletionStreamChoice(index=1, text="prompt 1\n out")]))
    _same(got, ref)
    assert cs.offsets[1] == len("prompt 1\n out")


def test_continuous_usage_keeps_pydantic_shape():
    sub = _sub(2)
    cs = CompletionStream(None, sub, 2, "cmpl-1", "m", "fp", include_usage=True, continuous_usage=True, echo_of=None)
    got = cs.delta(CompletionDelta(rid="r", index=0, text="x", token_ids=[7], finish_reason="stop"))
    usage = UsageInfo(prompt_tokens=5, completion_tokens=6, total_tokens=11,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=2))
    ref = sse(CompletionChunk(id="cmpl-1", created=cs.created, model="m", system_fingerprint="fp",
                              choices=[CompletionStreamChoice(index=0, text="x", finish_reason="stop")], usage=usage))
    _same(got, ref)


def test_named_tool_chunks_keep_tool_calls():
    cs = ChatStream(None, _sub(1), 1, "chatcmpl-1", "m", None, include_usage=False, continuous_usage=False,
                    tools=ToolPlan(mode="named", name="get_weather"))
    first = json.loads(cs.delta(CompletionDelta(rid="r", index=0, text='{"city":', token_ids=[7]))[6:])
    calls = first["choices"][0]["delta"]["tool_calls"]
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": ""}, {"arguments": '{"city":'}]
    last = json.loads(cs.delta(CompletionDelta(rid="r", index=0, text="", token_ids=[8], finish_reason="stop"))[6:])
    assert last["choices"][0]["finish_reason"] == "tool_calls"
