"""OpenAI's Responses API, stateless: POST /v1/responses.

A request is translated into a chat completion request (``to_chat``) and served by the same path
(chat template, tools, output constraints, sampling); the answer is written back as a ``response``
object: ``output`` holds a ``message`` item with ``output_text`` and/or ``function_call`` items.

Supported: ``input`` as text or a list of items (messages with text content parts, ``function_call``
and ``function_call_output`` items of a tool loop), ``instructions`` (a system message first),
``max_output_tokens``, ``temperature``, ``top_p``, function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``, ``json_schema``), ``stream``
(OpenAI's typed events: ``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed``). Nothing is stored: ``previous_response_id``, ``conversation``,
``background`` and the like are 400s (the no-silent-drop rule of ``protocol``); ``store`` and
``metadata`` are accepted and ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Iterable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import Response

from idleless.server.chat_tools import ToolPlan, ToolStream
from idleless.server.context import ServerContext
from idleless.server.engine_client import Submission
from idleless.server.protocol import OFF, OFF_BOOL, APIError, ChatCompletionRequest, _Checked, parse_request
from idleless.server.streaming import answer, usage_of
from idleless.text.output import CompletionDelta


class ResponsesRequest(_Checked):
    """POST /v1/responses (see the module docstring)."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    text: Optional[dict[str, Any]] = None
    stream: Optional[bool] = False
    IGNORED: ClassVar[frozenset] = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier",
                                              "prompt_cache_key"})
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "previous_response_id": (None,), "conversation": (None,), "background": OFF_BOOL, "reasoning": (None,),
        "truncation": (None, "disabled"), "include": OFF, "prompt": (None,), "max_tool_calls": (None,),
        "top_logprobs": (None, 0), "stream_options": (None,)}


def _text_of(content: Any, param: str) -> str:
    """A message's content (text, or a list of input_text / output_text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be text or a list of content parts", param=param, code="invalid_value")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise APIError(400, f"{param}[{j}]: only text parts (input_text, output_text) are supported",
                           param=f"{param}[{j}]", code="unsupported_parameter")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(req: ResponsesRequest) -> list[dict]:
    msgs: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return msgs + [{"role": "user", "content": req.input}]
    if not req.input:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input", code="invalid_value")
    for i, item in enumerate(req.input):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"input[{i}].role must be user, assistant, system or developer",
                               param=f"input[{i}].role", code="invalid_value")
            msgs.append({"role": role, "content": _text_of(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
                msgs[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        else:
            raise APIError(400, f"input[{i}]: item type {kind!r} is not supported (message, function_call, "
                           "function_call_output)", param=f"input[{i}].type", code="unsupported_parameter")
    return msgs


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves ``req``; APIError(400) for what cannot be translated."""
    body: dict[str, Any] = {"messages": _messages(req), "stream": bool(req.stream)}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for k in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, k) is not None:
            body[k] = getattr(req, k)
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise APIError(400, f"tools[{i}]: only function tools are supported, got {t.get('type')!r}",
                               param=f"tools[{i}].type", code="unsupported_parameter")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                              "strict") if t.get(k) is not None}})
        body["tools"] = tools
    tc = req.tool_choice
    if isinstance(tc, dict):
        tc = {"type": "function", "function": {"name": tc.get("name")}} if tc.get("type") == "function" else tc
    if tc is not None:
        body["tool_choice"] = tc
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format",
                           code="invalid_value")
        if fmt["type"] == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "output"), "schema": fmt.get("schema", {"type": "object"}),
                "strict": fmt.get("strict")}}
        elif fmt["type"] == "json_object":
            body["response_format"] = {"type": "json_object"}
    return parse_request(ChatCompletionRequest, body)


def _usage(sub: Submission) -> dict:
    u = usage_of(sub, 1)
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
            "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseShell:
    """The response object's fields that do not depend on the output."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        fmt = (req.text or {}).get("format") or {"type": "text"}
        self.fields = {
            "id": self.id, "object": "response", "created_at": self.created, "model": model,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0, "tools": req.tools or [],
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False, "text": {"format": fmt},
            "previous_response_id": None, "reasoning": None, "store": False, "truncation": "disabled",
            "metadata": {}, "error": None}

    def body(self, status: str, output: list[dict], usage: Optional[dict], reason: Optional[str]) -> dict:
        incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
        if status == "completed" and incomplete:
            status = "incomplete"
        return {**self.fields, "status": status, "incomplete_details": incomplete, "output": output, "usage": usage}


def _event(kind: str, seq: int, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields}, ensure_ascii=False)}\n\n"


class ResponsesStream:
    """The typed events of a streamed response (module docstring); one choice."""

    def __init__(self, shell: ResponseShell, sub: Submission, tools: ToolPlan):
        self.shell, self.sub = shell, sub
        self.ts = ToolStream(tools)
        self.seq = 0
        self.output: dict[int, dict] = {}  # output_index -> finished item
        self.next_index = 0  # the output_index the next item (message or call) takes, in the order opened
        self.msg_id: Optional[str] = None
        self.msg_index = 0
        self.text = ""
        self.calls: dict[int, dict] = {}  # tool-call index -> its item (open)

    def _ev(self, kind: str, **fields) -> str:
        self.seq += 1
        return _event(kind, self.seq - 1, **fields)

    def opening(self) -> Iterable[str]:
        skeleton = self.shell.body("in_progress", [], None, None)
        yield self._ev("response.created", response=skeleton)
        yield self._ev("response.in_progress", response=skeleton)

    def _close_message(self) -> list[str]:
        if self.msg_id is None:
            return []
        idx = self.msg_index
        item = _message_item(self.msg_id, self.text)
        part = item["content"][0]
        self.output[idx] = item
        self.msg_id, self.text = None, ""
        return [self._ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                         text=self.text, logprobs=[]),
                self._ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                         part=part),
                self._ev("response.output_item.done", output_index=idx, item=item)]

    def delta(self, d: CompletionDelta) -> Optional[str]:
        final = d.finish_reason is not None
        text, calls = self.ts.feed(d.text, final)
        out: list[str] = []
        if text:
            if self.msg_id is None:
                self.msg_id = f"msg_{uuid.uuid4().hex[:24]}"
                self.msg_index, self.next_index = self.next_index, self.next_index + 1
                idx = self.msg_index
                out.append(self._ev("response.output_item.added", output_index=idx,
                                    item={**_message_item(self.msg_id, "", "in_progress"), "content": []}))
                out.append(self._ev("response.content_part.added", item_id=self.msg_id, output_index=idx,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            self.text += text
            out.append(self._ev("response.output_text.delta", item_id=self.msg_id, output_index=self.msg_index,
                                content_index=0, delta=text, logprobs=[]))
        for c in calls:
            if c.id is not None:
                out += self._close_message()
                item = _call_item(c.id, c.function.name, "", "in_progress")
                self.calls[c.index] = item
                item["output_index"], self.next_index = self.next_index, self.next_index + 1
                out.append(self._ev("response.output_item.added", output_index=item["output_index"],
                                    item={k: v for k, v in item.items() if k != "output_index"}))
            item = self.calls[c.index]
            if c.function.arguments:
                item["arguments"] += c.function.arguments
                out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=item["output_index"], delta=c.function.arguments))
        if final:
            out += self._close_message()
            for i in sorted(self.calls):
                item = self.calls[i]
                oi = item.pop("output_index")
                item["status"] = "completed"
                out.append(self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=oi,
                                    arguments=item["arguments"]))
                out.append(self._ev("response.output_item.done", output_index=oi, item=item))
                self.output[oi] = item
            items = [self.output[i] for i in sorted(self.output)]
            body = self.shell.body("completed", items, _usage(self.sub), d.finish_reason)
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            out.append(self._ev(kind, response=body))
        return "".join(out) or None

    def closing(self) -> Iterable[str]:
        return ()


def register(app: FastAPI, ctx: ServerContext) -> None:
    """Add POST /v1/responses to ``app``."""
    tok = ctx.tok

    @app.post("/v1/responses")
    async def responses(request: Request):
        req = parse_request(ResponsesRequest, await ctx.read_json(request))
        model = ctx.check_model(req.model)
        chat = to_chat(req)
        params = chat.sampling_params()
        kwargs = chat.template_kwargs()
        tools, params = ToolPlan.of(chat, params, ctx.tool_parser, tok.chat_template, kwargs)
        ids = await ctx.render_chat([m.to_template() for m in chat.messages], **kwargs)
        sub = ctx.submit([ids], params)
        shell = ResponseShell(req, model)

        def full(outs):
            o = outs[0]
            content, calls, reason = tools.reply(o.text, o.finish_reason)
            output = [_message_item(f"msg_{uuid.uuid4().hex[:24]}", content)] if content else []
            output += [_call_item(c.id, c.function.name, c.function.arguments) for c in calls]
            body = shell.body("completed", output, _usage(sub), o.finish_reason)
            return Response(json.dumps(body, ensure_ascii=False), media_type="application/json")

        return await answer(request, sub, bool(req.stream), full, lambda: ResponsesStream(shell, sub, tools))
