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


def _call_of(obj: Any) -> Optional[ToolCall]:
    """``{"name": str, "arguments" | "parameters": object}`` as a ToolCall; None for anything else."""
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
    return ToolCall.new(obj["name"], args)


class ToolParser:
    """Finds tool calls in a reply. ``start``: the text that opens the tool-call part of a reply (None:
    the reply must start with one of ``leads``); streaming holds text back from there on."""

    start: Optional[str] = None
    leads: tuple[str, ...] = ()

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
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def _calls(self, body: str) -> Optional[list[ToolCall]]:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        call = _call_of(obj)
        return None if call is None else [call]

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
    def _calls(self, body: str) -> Optional[list[ToolCall]]:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_of(o) for o in items]
        return None if any(c is None for c in calls) else calls


class Llama3JsonParser(ToolParser):
    leads = ("<|python_tag|>", "{")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        dec = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, end = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call_of(obj)
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


def calls_of_required(text: str) -> list[ToolCall]:
    """The calls of a reply constrained by ``required_schema`` ([] if it was cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [c for c in (_call_of(i) for i in items if isinstance(i, dict)) if c is not None]


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
