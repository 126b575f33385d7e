"""What a request constrains its output to: a small, hashable, picklable description.

A ``StructuredOutput`` travels with the request (``SamplingParams.structured_output``) from the
frontend to the engine core, where ``idleless.structured.grammar`` compiles it (once per distinct
value: it is the compile cache's key) into a grammar that masks the sampler's logits. Nothing here
imports the grammar engine, so the request vocabulary stays light.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")


@dataclass(frozen=True)
class StructuredOutput:
    """One output constraint.

    kind: ``json_schema`` (value: the schema as canonical JSON text), ``json_object`` (any JSON object;
    value ""), ``regex`` (value: the pattern, xgrammar's ECMAScript-like regex syntax), ``choice`` (value:
    a JSON list of the allowed strings), ``ebnf`` (value: a GBNF/EBNF grammar whose start rule is
    ``root``, xgrammar's syntax).
    Build with the ``of_*`` constructors, which serialise the value one way (the schema's property
    order kept: it is the generation order), so equal constraints share one compiled grammar. Raises
    ValueError for an unknown kind."""

    kind: str
    value: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}; one of {KINDS}")

    @classmethod
    def of_json_schema(cls, schema: Any) -> "StructuredOutput":
        """A JSON schema given as a dict/bool or as JSON text (ValueError when the text is not JSON)."""
        if isinstance(schema, str):
            schema = json.loads(schema)
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def of_choice(cls, choices: Sequence[str]) -> "StructuredOutput":
        """Exactly one of ``choices`` (non-empty strings; ValueError otherwise)."""
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice needs a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))
