"""The output-constraint fields clients send, turned into one ``StructuredOutput`` (or None).

OpenAI (chat and completions): ``response_format`` ``{"type": "text"}`` (none), ``{"type":
"json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
vLLM: ``structured_outputs`` ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`` and the
older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (EBNF), with
``guided_decoding_backend`` ``xgrammar`` / ``auto`` (the only engine here). SGLang: ``regex``,
``ebnf``, ``json_schema`` (schema text) at the top level of the OpenAI routes and in /generate's
``sampling_params``.

A request may set one constraint; two are a 400 naming the second. Every constraint is parsed by the
grammar engine here (``idleless.structured.grammar.check``, cached), so an invalid schema, regex or
grammar is a 400 in the OpenAI error shape naming the field, before anything is queued.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Iterable, Optional

from idleless.server.protocol import APIError
from idleless.structured import StructuredOutput

# vLLM's structured_outputs keys -> our kinds
_VLLM_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf",
              "json_object": "json_object"}
BACKENDS = (None, "auto", "xgrammar")


def _bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="invalid_value")


def make(kind: str, value: Any, param: str) -> StructuredOutput:
    """One constraint from a field's value; APIError(400) naming ``param`` when the value has the wrong
    type or the grammar engine cannot parse it."""
    try:
        if kind == "json_schema":
            if not isinstance(value, (dict, bool, str)):
                raise _bad(param, "must be a JSON schema (an object, or its JSON text)")
            spec = StructuredOutput.of_json_schema(value)
        elif kind == "choice":
            if not isinstance(value, list):
                raise _bad(param, "must be a list of strings")
            spec = StructuredOutput.of_choice(value)
        elif kind == "json_object":
            spec = StructuredOutput("json_object")
        else:
            if not isinstance(value, str) or not value:
                raise _bad(param, "must be a non-empty string")
            spec = StructuredOutput(kind, value)
        _check(spec)
    except ValueError as e:
        raise _bad(param, f"invalid {kind.replace('_', ' ')}: {e}") from None
    return spec


@functools.lru_cache(maxsize=512)
def _check(spec: StructuredOutput) -> None:
    from idleless.structured.grammar import check
    check(spec)


def from_response_format(rf: Any) -> Optional[StructuredOutput]:
    """OpenAI's ``response_format``: None for text (or null), else the constraint."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or "type" not in rf:
        raise _bad("response_format", 'must be an object with a "type" (text, json_object or json_schema)')
    t = rf["type"]
    if t == "text":
        return None
    if t == "json_object":
        return StructuredOutput("json_object")
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema", 'must be an object with "name" and "schema"')
        schema = js.get("schema", {"type": "object"})  # OpenAI's SDK always sends one; vLLM's default
        return make("json_schema", schema, "response_format.json_schema.schema")
    raise _bad("response_format.type", f"must be text, json_object or json_schema, got {t!r}")


def from_structured_outputs(so: Any) -> Optional[StructuredOutput]:
    """vLLM's ``structured_outputs`` object: exactly one of json, regex, choice, grammar, json_object."""
    if so is None:
        return None
    if not isinstance(so, dict):
        raise _bad("structured_outputs", "must be an object")
    found = []
    for k, v in so.items():
        if k == "backend":
            check_backend(v, "structured_outputs.backend")
        elif k not in _VLLM_KEYS:
            raise APIError(400, f"structured_outputs.{k} is not supported by this server",
                           param=f"structured_outputs.{k}", code="unsupported_parameter")
        elif v is not None and v is not False:
            found.append(make(_VLLM_KEYS[k], v, f"structured_outputs.{k}"))
    if len(found) > 1:
        raise _bad("structured_outputs", "set one of json, regex, choice, grammar, json_object")
    return found[0] if found else None


def check_backend(value: Any, param: str) -> None:
    if value not in BACKENDS:
        raise APIError(400, f"{param}: this server's only grammar engine is xgrammar, got {value!r}", param=param,
                       code="unsupported_parameter")


def one_of(candidates: Iterable[tuple[str, Optional[StructuredOutput]]]) -> Optional[StructuredOutput]:
    """The single constraint among (field name, constraint or None) pairs; APIError(400) naming the
    second field when two are set."""
    chosen: Optional[tuple[str, StructuredOutput]] = None
    for name, spec in candidates:
        if spec is None:
            continue
        if chosen is not None:
            raise APIError(400, f"{name} and {chosen[0]} both constrain the output; set one", param=name,
                           code="invalid_value")
        chosen = (name, spec)
    return chosen[1] if chosen else None


def schema_text(value: Any, param: str) -> Any:
    """SGLang's ``json_schema`` is JSON text; a dict is taken as is. APIError(400) for text that is
    not JSON."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise _bad(param, f"is not valid JSON: {e}") from None
    return value
