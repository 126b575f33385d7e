"""Tools on /v1/chat/completions: what a request's ``tools`` / ``tool_choice`` change (the rendered
prompt, the output constraint) and how a reply becomes ``tool_calls``, whole or streamed.

``ToolPlan.of(req, ...)``: ``none`` renders no tools; ``named`` constrains the reply to the function's
arguments (JSON schema); ``required`` to a JSON list of calls (``tool_calls.required_schema``); ``auto``
lets the model answer and reads calls with the server's parser (``--tool-call-parser``). A chat
template that ignores tools is replaced, for ChatML templates, by ``SMOLLM2_TOOLS_TEMPLATE``.

``ToolStream``: one choice's streamed reply as OpenAI's deltas: content while it is surely not a call,
then per call a delta with its index, id, type and name and ``arguments: ""``, then the arguments in
pieces that concatenate to its JSON. ``finish_reason`` is ``tool_calls`` when a reply that ended
normally (``stop``) called a tool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from idleless.engine.request import SamplingParams
from idleless.server import constraints
from idleless.server.protocol import (APIError, ChatCompletionRequest, FunctionCallDelta, FunctionCallOut,
                                      ToolCallDelta, ToolCallOut)
from idleless.server.tool_calls import (SMOLLM2_TOOLS_TEMPLATE, ToolCall, ToolParser, calls_of_required,
                                        named_schema, required_schema)

ARGUMENT_PIECE = 16  # characters of arguments per streamed delta when a call is sent whole


@dataclass
class ToolPlan:
    """mode: none | auto | required | named; name: the named function; parser: auto's parser;
    parallel: more than one call per reply (``parallel_tool_calls``; auto keeps the first otherwise)."""

    mode: str = "none"
    name: Optional[str] = None
    parser: Optional[ToolParser] = None
    parallel: bool = True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """auto: the parser's (content, calls), cut to one call without parallel tool calls."""
        content, calls = self.parser.parse(text)
        return content, calls if self.parallel else calls[:1]

    @staticmethod
    def of(req: ChatCompletionRequest, params: SamplingParams, parser: Optional[ToolParser],
           template: Optional[str], template_kwargs: dict) -> tuple["ToolPlan", SamplingParams]:
        """The plan and the sampling params (with the tool constraint); adds ``tools`` (and a
        tool-aware ``chat_template`` when ``template``, the server's, ignores tools) to
        ``template_kwargs``. APIError(400): auto without a parser, tools with another output
        constraint (required / named), bad tools or tool_choice (``tool_mode``)."""
        mode, named = req.tool_mode()
        if mode == "none":
            return ToolPlan(), params
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        template_kwargs["tools"] = tools
        if template and "tools" not in template and "<|im_start|>" in template:
            template_kwargs["chat_template"] = SMOLLM2_TOOLS_TEMPLATE
        if mode == "auto":
            if parser is None:
                raise APIError(400, 'tool_choice "auto" needs a tool-call parser: start the server with '
                               "--tool-call-parser (hermes, smollm2, llama3_json), or use \"required\" or a "
                               "named function", param="tool_choice", code="invalid_value")
            return ToolPlan("auto", parser=parser, parallel=req.parallel_tool_calls is not False), params
        if params.structured_output is not None:
            raise APIError(400, f'tool_choice "{mode}" constrains the reply already; drop the output constraint',
                           param="tool_choice", code="invalid_value")
        if mode == "named":
            spec = constraints.make("json_schema", named_schema(named), "tool_choice")
            return ToolPlan("named", named["function"]["name"]), replace(params, structured_output=spec)
        spec = constraints.make("json_schema", required_schema(tools, req.parallel_tool_calls is not False),
                                "tools")
        return ToolPlan("required"), replace(params, structured_output=spec)

    def reply(self, text: str, finish_reason: Optional[str]) -> tuple[Optional[str], list[ToolCallOut], Optional[str]]:
        """(content, tool_calls, finish_reason) of a whole reply."""
        if self.mode == "none":
            return text, [], finish_reason
        if self.mode == "named":
            calls = [ToolCall.new(self.name, text)] if finish_reason == "stop" else []
            content = None if calls else text
        elif self.mode == "required":
            calls = calls_of_required(text)
            content = None if calls else text
        else:
            content, calls = self.parse(text)
            content = content or None
        out = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
        return content, out, ("tool_calls" if out and finish_reason == "stop" else finish_reason)


def _whole(index: int, call: ToolCall) -> list[ToolCallDelta]:
    """A call as deltas: the header (id, type, name, empty arguments), then its arguments in pieces."""
    out = [ToolCallDelta(index=index, id=call.id, type="function", function=FunctionCallDelta(name=call.name,
                                                                                              arguments=""))]
    a = call.arguments
    out += [ToolCallDelta(index=index, function=FunctionCallDelta(arguments=a[i:i + ARGUMENT_PIECE]))
            for i in range(0, len(a), ARGUMENT_PIECE)]
    return out


class ToolStream:
    """One choice's reply, streamed under a ``ToolPlan`` (module docstring)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.buf = ""
        self.sent = 0  # characters of buf already sent as content
        self.num_calls = 0
        self.named_id: Optional[str] = None

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """(content, tool-call deltas) to send for the next piece of the reply; ``final``: the last one."""
        mode = self.plan.mode
        if mode == "none":
            return text, []
        if mode == "named":
            deltas = []
            if self.named_id is None:
                self.named_id = ToolCall.new(self.plan.name, "").id
                self.num_calls = 1
                deltas.append(ToolCallDelta(index=0, id=self.named_id, type="function",
                                            function=FunctionCallDelta(name=self.plan.name, arguments="")))
            if text:
                deltas.append(ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text)))
            return "", deltas
        self.buf += text
        if mode == "required":
            if not final:
                return "", []
            calls = calls_of_required(self.buf)
            return ("" if calls else self.buf), self._deltas(calls)
        if not final:
            k = max(self.plan.parser.split(self.buf), self.sent)
            piece, self.sent = self.buf[self.sent:k], k
            return piece, []
        rest = self.buf[self.sent:]
        content, calls = self.plan.parse(rest)
        return (content if calls else rest), self._deltas(calls)

    def _deltas(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        out = []
        for c in calls:
            out += _whole(self.num_calls, c)
            self.num_calls += 1
        return out

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if self.num_calls and reason == "stop" else reason
