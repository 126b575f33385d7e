"""``ResponsesStream`` on a scripted hermes reply (no model): content, a tool call, then more content.
Every item gets its own ``output_index`` in the order it opened (the message after a streamed call once
took the call's index), and the completed response lists the items in that order."""

from __future__ import annotations

import json
import types

from idleless.server import routes_responses
from idleless.server.chat_tools import ToolPlan
from idleless.server.tool_calls import make_parser
from idleless.text.output import CompletionDelta


def _events(chunks: list[str]) -> list[dict]:
    out = []
    for chunk in chunks:
        for block in chunk.strip().split("\n\n"):
            out.append(json.loads(block.split("data: ", 1)[1]))
    return out


def test_items_after_a_streamed_call_take_the_next_index(monkeypatch):
    monkeypatch.setattr(routes_responses, "_usage", lambda sub: {})
    shell = types.SimpleNamespace(body=lambda status, output, usage, reason: {"status": status, "output": output})
    stream = routes_responses.ResponsesStream(shell, None, ToolPlan(mode="auto", parser=make_parser("hermes")))
    pieces = ["Let me check. ", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}',
              "</tool_call>", " Done."]
    chunks = []
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        d = CompletionDelta(rid="r", index=0, text=p, token_ids=[i], finish_reason="stop" if last else None)
        c = stream.delta(d)
        if c:
            chunks.append(c)
    ev = _events(chunks)
    added = [(e["output_index"], e["item"]["type"]) for e in ev if e["type"] == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call"), (2, "message")]
    done = {e["output_index"]: e["item"] for e in ev if e["type"] == "response.output_item.done"}
    assert sorted(done) == [0, 1, 2]
    assert done[0]["content"][0]["text"] == "Let me check. "
    assert json.loads(done[1]["arguments"]) == {"city": "Paris"} and done[1]["name"] == "get_weather"
    assert done[2]["content"][0]["text"].strip() == "Done."
    args = "".join(e["delta"] for e in ev if e["type"] == "response.function_call_arguments.delta")
    assert args == done[1]["arguments"]
    final = ev[-1]
    assert final["type"] == "response.completed"
    assert [item["type"] for item in final["response"]["output"]] == ["message", "function_call", "message"]
