"""Structured outputs: per-request constraints (JSON schema, regex, choice, grammar) compiled with xgrammar, a
matcher per request, and the step's token bitmask (see ``docs/structured-outputs.md``)."""

from cbrun.engine.structured_output.params import KINDS, StructuredOutputsParams, coerce_structured_outputs

__all__ = ["KINDS", "StructuredOutputsParams", "coerce_structured_outputs"]
