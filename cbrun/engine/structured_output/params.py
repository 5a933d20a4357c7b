"""What a request's output must match: ``StructuredOutputsParams`` (vLLM's name and fields), and its cache key."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cbrun.engine.structured_output.schema_support import check_schema

#: The constraint kinds, in the order a key names them (vLLM's ``StructuredOutputsParams`` fields).
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one field is set.

    Attributes:
        json: a JSON schema, as a dict or as its JSON text; the output is a JSON value valid under it.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar: EBNF (xgrammar's GBNF dialect, rules ``name ::= ...``, the start rule
            ``root``), or Lark (rules ``name: ...``, the start rule ``start``) when the text has no ``::=``.
        json_object: any JSON object (OpenAI's ``response_format = {"type": "json_object"}``).

    Raises:
        ValueError: from ``validate`` for none or several constraints, or a value of the wrong type.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    def validate(self, name: str = "structured_outputs") -> None:
        """Raise ``ValueError`` for none or several constraints, or a value of the wrong type, naming the
        constraint's field as ``NAME.FIELD`` (``name``: the setting or column that holds it)."""
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"{name} needs exactly one of {', '.join(KINDS)}; got {', '.join(set_kinds) or 'none'}")
        kind = set_kinds[0]
        value = getattr(self, kind)
        if kind == "json":
            self._check_schema(f"{name}.json", value)
        elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"{name}.{kind} must be non-empty text, got {value!r}")
        elif kind == "choice" and (not value or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"{name}.choice must be a list of non-empty strings, got {value!r}")
        elif kind == "json_object" and value is not True:
            raise ValueError(f"{name}.json_object must be true, got {value!r}")

    @staticmethod
    def _check_schema(name: str, value: Any) -> None:
        """A ``json`` constraint is a schema (a dict, or its JSON text) of what some engine enforces (formats
        are checked when the request is routed)."""
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"{name} is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(f"{name} must be a JSON schema (an object), got {value!r}")
        elif not isinstance(value, dict):
            raise ValueError(f"{name} must be a schema (a dict or its JSON text), got {value!r}")
        try:
            check_schema(schema, ignore_formats=True)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None

    @property
    def kind(self) -> str:
        """The constraint's kind: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def json_schema(self) -> dict | bool | None:
        """The JSON schema as a dict (``json``; ``json_object``: ``{"type": "object"}``), else None."""
        if self.json_object:
            return {"type": "object"}
        if self.json is None:
            return None
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, canonical text)``: equal for equal constraints, so the compiled grammar cache and the job
        fingerprint see one constraint once (a schema's key order is kept: the output follows it)."""
        kind = self.kind
        if kind in ("json", "json_object"):
            return kind, json.dumps(self.json_schema, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        return kind, getattr(self, kind)

    def to_dict(self) -> dict[str, Any]:
        """``{kind: value}`` as JSON-ready values (the job fingerprint's entry)."""
        kind, text = self.key
        return {kind: json.loads(text) if kind in ("json", "json_object", "choice") else text}


def coerce_structured_outputs(name: str, value: Any) -> StructuredOutputsParams | None:
    """A per-row or manifest value as ``StructuredOutputsParams``: one itself, or a dict (a Parquet struct, a TOML
    table, JSON) holding one of ``KINDS``; keys with null values are left out (a struct column's other fields).

    Raises:
        ValueError: naming ``name``, for another type, an unknown key, or a constraint ``validate`` refuses.
    """
    if value is None or isinstance(value, StructuredOutputsParams):
        params = value
    elif isinstance(value, dict):
        given = {k: v for k, v in value.items() if v is not None}
        unknown = sorted(set(given) - set(KINDS))
        if unknown:
            raise ValueError(f"{name}: unknown key(s) {unknown}; expected one of {', '.join(KINDS)}")
        params = StructuredOutputsParams(**given)
    elif isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError(
                f"{name} must be an object holding one of {', '.join(KINDS)} (or its JSON text), got {value!r}"
            )
        return coerce_structured_outputs(name, parsed)
    else:
        raise ValueError(f"{name} must be an object holding one of {', '.join(KINDS)}, got {value!r}")
    if params is not None:
        params.validate(name)
    return params
