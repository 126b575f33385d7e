"""Structured outputs: constraints on a request's output (JSON schema, regex, choice, EBNF grammar) turned into token masks for the sampler (DESIGN.md section 7). ``spec`` describes a
constraint; ``grammar`` compiles it (xgrammar) and keeps the engine core's per-request state."""

from idleless.structured.spec import StructuredOutput  # noqa: F401
