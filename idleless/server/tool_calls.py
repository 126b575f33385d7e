"""Tool calls: the parsers that find them in a model's text, and the constraints that force them.

Parsers by name (``--tool-call-parser``, vLLM's and SGLang's names where they exist):

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call (Hermes
  2 Pro, Qwen2.5, ...), text outside the blocks is content;
* ``smollm2``: ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``, one block holding a
  JSON list (an object is taken too): the format SmolLM2-Instruct was trained on (the "Function
  calling" section of HuggingFaceTB/SmolLM2-1.7B-Instruct's model card, and ollama's smollm2
  template); ``SMOLLM2_TOOLS_TEMPLATE`` is a chat template that renders tools and tool turns that way;
* ``llama3_json``: Llama 3.1/3.2's JSON tool calls: the reply is ``{"name": ..., "parameters": {...}}``
  (``arguments`` taken too), optionally after ``<|python_tag|>``, several separated by ``;``.

``tool_choice`` ``required`` and a named function do not depend on the parser: the output is
constrained by a JSON schema (``required_schema``, ``named_schema``: vLLM's approach), so arguments
always parse and match the tool's parameters; ``auto`` lets the model choose and the parser reads the
text; ``none`` renders no tools and returns text.

A call's ``arguments`` is the JSON text of its arguments object as the model wrote it when the call
reads ``{"name": ..., "arguments" | "parameters": {...}, ...}`` (name first), so that the pieces a
``CallStreamer`` sends while the model writes it concatenate to the same text; in any other shape
(another key order, arguments given as a JSON string) it is ``json.dumps`` of the arguments, and
streaming sends such a call whole once the reply is done.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

PARSERS = ("hermes", "smollm2", "llama3_json")


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name, its arguments as JSON text, and the call's id (``call_...``)."""

    name: str
    arguments: str
    id: str = ""

    @staticmethod
    def new(name: str, arguments: Any) -> "ToolCall":
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(name, args, f"call_{uuid.uuid4().hex[:24]}")


_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
MORE = "more"  # _header: the text so far is a prefix of a call's header
NOT_STREAMABLE = "not-streamable"  # _header: the call (if it is one) is not in the name-first shape


def _header(text: str, pos: int):
    """Where a call's arguments start: ``(name, index)`` of its arguments object when ``text[pos:]``
    begins ``{"name": "<name>", "arguments" | "parameters": {`` (JSON whitespace anywhere between the
    tokens); ``MORE`` while the text so far is a prefix of that; ``NOT_STREAMABLE`` otherwise."""
    name = None
    for want in ("{", '"name"', ":", "<name>", ",", "<key>", ":"):
        pos = _WS.match(text, pos).end()
        if pos == len(text):
            return MORE
        if want.startswith("<"):
            m = _STRING.match(text, pos)
            if m is None:
                return MORE if text[pos] == '"' else NOT_STREAMABLE
            try:
                value = json.loads(m.group())
            except ValueError:
                return NOT_STREAMABLE
            if want == "<name>":
                name = value
            elif value not in ("arguments", "parameters"):
                return NOT_STREAMABLE
            pos = m.end()
        elif text.startswith(want, pos):
            pos += len(want)
        else:
            return MORE if want.startswith(text[pos:]) else NOT_STREAMABLE
    pos = _WS.match(text, pos).end()
    if pos == len(text):
        return MORE
    return (name, pos) if text[pos] == "{" else NOT_STREAMABLE


def _call_of(obj: Any, raw: Optional[str] = None) -> Optional[ToolCall]:
    """``{"name": str, "arguments" | "parameters": object}`` as a ToolCall; None for anything else.
    ``raw``: the arguments' JSON text as written (kept as the call's arguments)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall.new(obj["name"], args if raw is None else raw)


def _call_at(text: str, pos: int) -> tuple[Optional[ToolCall], int]:
    """The JSON value at ``text[pos]`` as a call (None when it is not one) and the index after it;
    arguments as written when the call is name-first (module docstring). ValueError: no JSON value."""
    obj, end = _DECODER.raw_decode(text, pos)
    head = _header(text, pos)
    raw = None
    if isinstance(head, tuple):
        _, vend = _DECODER.raw_decode(text, head[1])
        raw = text[head[1]:vend]
    return _call_of(obj, raw), end


def _one(text: str) -> Optional[list[Optional[ToolCall]]]:
    """A whole text that is one JSON object or a list of them (surrounding whitespace aside): the
    items as calls (None for an item that is not one); None when the text is not such JSON."""
    pos = _WS.match(text).end()
    try:
        if text.startswith("[", pos):
            calls, end = [], _WS.match(text, pos + 1).end()
            if text.startswith("]", end):
                end += 1
            else:
                while True:
                    call, end = _call_at(text, end)
                    calls.append(call)
                    end = _WS.match(text, end).end()
                    if text.startswith(",", end):
                        end = _WS.match(text, end + 1).end()
                    elif text.startswith("]", end):
                        end += 1
                        break
                    else:
                        return None
        else:
            call, end = _call_at(text, pos)
            calls = [call]
    except ValueError:
        return None
    return calls if _WS.match(text, end).end() == len(text) else None


@dataclass(frozen=True)
class CallPiece:
    """A streamed piece of call ``index`` (0, 1, ... in reply order): ``name`` in its first piece
    only (with ``arguments`` ""), then pieces of its arguments text."""

    index: int
    arguments: str
    name: Optional[str] = None


_JSON_OUTSIDE_STRINGS = frozenset(" \t\n\r{}[],:-+.0123456789eEtrufalsnNIiy")


class _ValueEnd:
    """Follows JSON text as it arrives to find where a value that opened at ``depth`` brackets ends
    (the bracket that brings the depth to 0), minding strings and escapes."""

    def __init__(self, depth: int):
        self.depth, self.in_string, self.escaped = depth, False, False

    def scan(self, text: str, pos: int) -> tuple[int, Optional[bool]]:
        """(end, done) for ``text[pos:]``: the text up to ``end`` belongs to the value; done: True
        when the value closed at ``end``, False when the text is not JSON there, None: not yet."""
        for i in range(pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
            elif c not in _JSON_OUTSIDE_STRINGS:
                return i, False
        return len(text), None


class CallStreamer:
    """Reads calls out of a reply while it is written, for streaming: as soon as a call's name is
    known its first piece goes out, then its arguments text as it grows. Nothing else is ever sent:
    the arguments are followed bracket by bracket, so the text after them (``}``, ``</tool_call>``,
    ``,``) stays back. A call in another shape than name-first (``_header``) stops the streamer; the
    caller sends the rest whole from the finished reply's parse (``ToolStream``).

    ``kind``: ``blocks`` (``opener`` then one object, or with ``lists`` a JSON list of objects, per
    block: hermes, smollm2), ``sequence`` (objects separated by whitespace or ``;`` after an optional
    ``prefix``: llama3_json) or ``list`` (one JSON list of objects: ``required``). ``max_calls``:
    stop after that many calls (no parallel tool calls)."""

    def __init__(self, kind: str, opener: str = "", lists: bool = False, prefix: str = "",
                 max_calls: Optional[int] = None):
        self.kind, self.opener, self.lists, self.prefix, self.max_calls = kind, opener, lists, prefix, max_calls
        self.state = {"blocks": "between", "sequence": "prefix", "list": "list"}[kind]
        self.pos = 0
        self.calls = 0
        self.in_list = False
        self.value: Optional[_ValueEnd] = None

    def feed(self, text: str) -> list[CallPiece]:
        """The pieces that ``text`` (the tool-call part of the reply so far; each call passes it
        grown) adds to what earlier calls returned."""
        out: list[CallPiece] = []
        while self._step(text, out):
            pass
        return out

    def _skip(self, text: str, chars: str = " \t\n\r") -> bool:
        """Moves past ``chars``; False at the end of the text."""
        while self.pos < len(text) and text[self.pos] in chars:
            self.pos += 1
        return self.pos < len(text)

    def _step(self, text: str, out: list[CallPiece]) -> bool:
        """One move of the state machine; False when it needs more text (or stopped)."""
        st = self.state
        if st == "between":
            i = text.find(self.opener, self.pos)
            if i < 0:
                return False
            self.pos, self.state = i + len(self.opener), "block"
        elif st == "block" or st == "list":
            if not self._skip(text):
                return False
            self.in_list = text[self.pos] == "[" and (self.lists or st == "list")
            if self.in_list:
                self.pos += 1
                self.state = "item"
            else:
                self.state = "object" if st == "block" else "stopped"
        elif st == "prefix":
            if not self._skip(text):
                return False
            rest = text[self.pos:self.pos + len(self.prefix)]
            if self.prefix and rest == self.prefix:
                self.pos += len(self.prefix)
            elif self.prefix.startswith(rest) and rest:
                return False
            self.state = "object"
        elif st == "item":
            if not self._skip(text):
                return False
            self.state = "object"
        elif st == "object":
            if self.max_calls is not None and self.calls >= self.max_calls:
                self.state = "stopped"
                return False
            head = _header(text, self.pos)
            if head == MORE:
                return False
            if head == NOT_STREAMABLE:
                self.state = "stopped"
                return False
            name, self.pos = head
            out.append(CallPiece(self.calls, "", name))
            self.calls += 1
            self.value, self.state = _ValueEnd(0), "arguments"
        elif st in ("arguments", "rest"):
            end, done = self.value.scan(text, self.pos)
            if st == "arguments" and end > self.pos:
                out.append(CallPiece(self.calls - 1, text[self.pos:end]))
            self.pos = end
            if done is None:
                return False
            if not done:
                self.state = "stopped"
            elif st == "arguments":
                self.value, self.state = _ValueEnd(1), "rest"  # the call's object after its arguments
            else:
                self.state = "after"
        elif st == "after":
            if self.in_list:
                if not self._skip(text):
                    return False
                c = text[self.pos]
                self.pos += 1
                self.state = "item" if c == "," else "between" if c == "]" and self.kind == "blocks" else "stopped"
            elif self.kind == "sequence":
                if not self._skip(text, " \t\n\r;"):
                    return False
                self.state = "object"
            else:
                self.state = "between"
        else:  # stopped
            return False
        return True


class ToolParser:
    """Finds tool calls in a reply. ``start``: the text that opens the tool-call part of a reply (None:
    the reply must start with one of ``leads``); streaming holds text back from there on."""

    start: Optional[str] = None
    leads: tuple[str, ...] = ()

    def streamer(self, max_calls: Optional[int] = None) -> CallStreamer:
        """A ``CallStreamer`` for the tool-call part of one reply (from ``begin``)."""
        raise NotImplementedError

    def begin(self, text: str) -> Optional[int]:
        """Where the tool-call part of a streamed reply surely begins (None: not yet known): at
        ``start``, or for a parser with ``leads`` at 0 once the reply starts with one."""
        if self.start is not None:
            i = text.find(self.start)
            return i if i >= 0 else None
        return 0 if text.lstrip().startswith(self.leads) else None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls): the reply's text outside tool calls and the calls in order. Text that
        looks like a call but does not parse stays content, and no call is returned for it."""
        raise NotImplementedError

    def split(self, text: str) -> int:
        """How many leading characters of a streamed reply are content for sure: up to the start of
        the tool-call part, or of a suffix that may be its beginning."""
        if self.start is None:
            stripped = text.lstrip()
            if not stripped:
                return 0
            for lead in self.leads:
                if stripped.startswith(lead) or lead.startswith(stripped):
                    return 0
            return len(text)
        i = text.find(self.start)
        if i >= 0:
            return i
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class HermesParser(ToolParser):
    """``--tool-call-parser hermes``: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (NousResearch's Hermes function-calling format); text before the first tag is content."""

    start = "<tool_call>"
    lists = False

    def streamer(self, max_calls: Optional[int] = None) -> CallStreamer:
        return CallStreamer("blocks", opener=self.start, lists=self.lists, max_calls=max_calls)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def _calls(self, body: str) -> Optional[list[ToolCall]]:
        if body.lstrip().startswith("["):
            return None
        calls = _one(body)
        return None if calls is None or calls[0] is None else calls

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        for m in self._block.finditer(text):
            found = self._calls(m.group(1))
            if found is None:
                continue
            content.append(text[pos:m.start()])
            calls += found
            pos = m.end()
        content.append(text[pos:])
        return "".join(content).strip() if calls else text, calls


class SmolLM2Parser(HermesParser):
    """``--tool-call-parser smollm2``: hermes tags holding a JSON list of calls, the format of the
    "Function calling" section of SmolLM2-Instruct's model card."""

    lists = True

    def _calls(self, body: str) -> Optional[list[ToolCall]]:
        calls = _one(body)
        return None if calls is None or any(c is None for c in calls) else calls


class Llama3JsonParser(ToolParser):
    """``--tool-call-parser llama3_json``: Llama 3.1's JSON tool calls, ``{"name": ..., "parameters": {...}}``
    after an optional ``<|python_tag|>``, several separated by ``;`` (Meta's Llama 3.1 prompt format)."""

    leads = ("<|python_tag|>", "{")

    def streamer(self, max_calls: Optional[int] = None) -> CallStreamer:
        return CallStreamer("sequence", prefix="<|python_tag|>", max_calls=max_calls)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        i = 0
        while i < len(body):
            try:
                call, end = _call_at(body, i)
            except ValueError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \t\n;":
                i += 1
        return "", calls


def make_parser(name: str) -> ToolParser:
    """The parser called ``name`` (one of PARSERS); ValueError otherwise."""
    parsers = {"hermes": HermesParser, "smollm2": SmolLM2Parser, "llama3_json": Llama3JsonParser}
    if name not in parsers:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(PARSERS)}")
    return parsers[name]()


def parameters_of(tool: dict) -> dict:
    """A tool's parameters schema (an object with no properties when it has none)."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def named_schema(tool: dict) -> dict:
    """tool_choice naming a function: the reply is that function's arguments."""
    return parameters_of(tool)


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """tool_choice ``required``: the reply is a JSON list of ``{"name", "parameters"}`` calls (at
    least one; exactly one without parallel tool calls), each naming a tool with its arguments."""
    one = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": parameters_of(t)},
            "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def required_streamer() -> CallStreamer:
    """A ``CallStreamer`` for a reply constrained by ``required_schema`` (which bounds the calls)."""
    return CallStreamer("list")


def calls_of_required(text: str) -> list[ToolCall]:
    """The calls of a reply constrained by ``required_schema`` ([] if it was cut short)."""
    if not text.lstrip().startswith("["):
        return []
    return [c for c in _one(text) or [] if c is not None]


# A chat template for SmolLM2-Instruct that renders tools, assistant tool calls and tool results in the
# format of its model card's "Function calling" section (the system prompt there is the one it was
# trained with); without tools it renders as SmolLM2's own template.
SMOLLM2_TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You are an expert in composing functions. You are given a question and a set of possible functions.
Based on the question, you will need to make one or more function/tool calls to achieve the purpose.
If none of the functions can be used, point it out and refuse to answer.
If the given question lacks the parameters required by the function, also point it out.

You have access to the following tools:
<tools>[{% for t in tools %}{{ (t.function if t.function is defined else t) | tojson }}\
{% if not loop.last %}, {% endif %}{% endfor %}]</tools>

The output MUST strictly adhere to the following format, and NO other text MUST be included.
The example format is as follows. Please make sure the parameter type is correct. If no function call is \
needed, please make the tool calls an empty list '[]'.
<tool_call>[
{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},
... (more tool calls as required)
]</tool_call>
{%- if messages and messages[0].role == 'system' %}

{{ messages[0].content }}{% endif %}<|im_end|>
{% elif not messages or messages[0].role != 'system' %}<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% if not tools %}<|im_start|>system
{{ m.content }}<|im_end|>
{% endif %}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.tool_calls %}<tool_call>[{% for c in m.tool_calls %}{"name": {{ c.function.name | tojson }}, \
"arguments": {{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]</tool_call>\
{% else %}{{ m.content }}{% endif %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
