"""Tools on /v1/chat/completions: what a request's ``tools`` / ``tool_choice`` change (the rendered
prompt, the output constraint) and how a reply becomes ``tool_calls``, whole or streamed.

``ToolPlan.of(req, ...)``: ``none`` renders no tools; ``named`` constrains the reply to the function's
arguments (JSON schema); ``required`` to a JSON list of calls (``tool_calls.required_schema``); ``auto``
lets the model answer and reads calls with the server's parser (``--tool-call-parser``). A chat
template that ignores tools is replaced, for ChatML templates, by ``SMOLLM2_TOOLS_TEMPLATE``.

``ToolStream``: one choice's streamed reply as OpenAI's deltas: content while it is surely not a call,
then per call (index 0, 1, ...) a delta with its index, id, type and name and ``arguments: ""`` as
soon as the name is written, then the arguments in pieces as the model writes them, which
concatenate to the non-streamed reply's ``arguments``. ``finish_reason`` is ``tool_calls`` when a
reply that ended normally (``stop``) called a tool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from idleless.engine.request import SamplingParams
from idleless.server import constraints
from idleless.server.protocol import (APIError, ChatCompletionRequest, FunctionCallDelta, FunctionCallOut,
                                      ToolCallDelta, ToolCallOut)
from idleless.server.tool_calls import (SMOLLM2_TOOLS_TEMPLATE, CallPiece, CallStreamer, ToolCall, ToolParser,
                                        calls_of_required, named_schema, required_schema, required_streamer)

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
    """One choice's reply, streamed under a ``ToolPlan`` (module docstring). ``auto`` and
    ``required`` read the calls with a ``CallStreamer`` as the text grows: content goes out until
    the tool-call part begins (``ToolParser.split`` / ``begin``); each call's header once its name is
    known, then its arguments as the model writes them. When the reply ends, the calls the streamer
    could not follow (another shape than name-first) go out whole from the reply's parse, then the
    content outside the calls. A call whose header went out stays a call: a reply cut short inside
    one (``length``) has sent the arguments written so far."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.buf = ""
        self.sent = 0  # characters of buf already sent as content
        self.tool_at: Optional[int] = None  # where the tool-call part of buf begins, once known
        self.streamer: Optional[CallStreamer] = None
        self.ids: list[str] = []  # the ids of the calls whose header went out, in order
        if plan.mode == "required":
            self.tool_at, self.streamer = 0, required_streamer()

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """(content, tool-call deltas) to send for the next piece of the reply; ``final``: the last one."""
        mode = self.plan.mode
        if mode == "none":
            return text, []
        if mode == "named":
            deltas = []
            if not self.ids:
                self.ids.append(ToolCall.new(self.plan.name, "").id)
                deltas.append(ToolCallDelta(index=0, id=self.ids[0], type="function",
                                            function=FunctionCallDelta(name=self.plan.name, arguments="")))
            if text:
                deltas.append(ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text)))
            return "", deltas
        self.buf += text
        content = ""
        if self.tool_at is None:
            t = self.plan.parser.begin(self.buf)
            k = max(self.plan.parser.split(self.buf) if t is None else t, self.sent)
            content, self.sent = self.buf[self.sent:k], k
            if t is None and not final:
                return content, []
            if t is not None:
                self.tool_at = t
                self.streamer = self.plan.parser.streamer(None if self.plan.parallel else 1)
        deltas = self._pieces(self.streamer.feed(self.buf[self.tool_at:])) if self.streamer else []
        if not final:
            return content, deltas
        rest = self.buf[self.sent:]
        if mode == "required":
            calls = calls_of_required(rest)
            left = "" if calls else rest
        else:
            left, calls = self.plan.parse(rest)  # left: the text outside the calls, all of rest without any
        for c in calls[len(self.ids):]:
            deltas += _whole(len(self.ids), c)
            self.ids.append(c.id)
        return content + ("" if self.ids and not calls else left), deltas

    def _pieces(self, pieces: list[CallPiece]) -> list[ToolCallDelta]:
        out = []
        for p in pieces:
            if p.name is not None:
                self.ids.append(ToolCall.new(p.name, "").id)
                out.append(ToolCallDelta(index=p.index, id=self.ids[-1], type="function",
                                         function=FunctionCallDelta(name=p.name, arguments="")))
            else:
                out.append(ToolCallDelta(index=p.index, function=FunctionCallDelta(arguments=p.arguments)))
        return out

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if self.ids and reason == "stop" else reason
