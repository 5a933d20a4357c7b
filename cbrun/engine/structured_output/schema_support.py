"""Which JSON Schema keywords each grammar engine enforces, as data, a walker that finds the first one it does not,
and the routing of a schema to an engine (``route``: ``structured_outputs_backend``).

Every row of ``XGRAMMAR`` and ``REFUSED`` was measured on the installed xgrammar (0.2.9): a schema using the keyword
is compiled the way ``cbrun.engine.structured_output.compiler`` compiles it, random walks through the grammar over a
character vocabulary produce completions, and ``jsonschema`` (with its format checker) validates each one
(``tests/engine/test_schema_support.py`` repeats the experiment for every row, and a tiny random model's greedy and
sampled completions under each accepted keyword). A keyword is enforced only in the forms that experiment passed:

- a type-specific keyword (``minimum``, ``maxLength``, ``minItems``, ``maxProperties``, ``format``, ...) only with a
  ``type`` that names its type (without one xgrammar ignores it);
- ``required`` only of names declared in ``properties`` (xgrammar never writes an undeclared property);
- ``multipleOf`` only on ``type: integer``; ``pattern`` not together with ``minLength`` / ``maxLength``;
- ``anyOf``, ``oneOf``, ``allOf`` and ``$ref`` only without other constraining keywords beside them (xgrammar
  serves the branches or the target and drops the siblings); ``oneOf`` only when its branches are disjoint (a
  discriminator property with a distinct ``const`` in each, as Pydantic writes its unions, or distinct ``const``
  values or types), where it is an ``anyOf``; ``allOf`` only with one branch;
- ``enum`` / ``const`` beside other keywords only when every value satisfies them (xgrammar writes the values);
- ``patternProperties`` with one pattern, matching no declared property and without ``additionalProperties``;
  ``propertyNames`` without ``properties``;
- ``$ref`` only to ``#`` or a ``#/...`` pointer in the same document;
- ``format`` only for the values in ``XGRAMMAR_FORMATS`` (unless the caller ignores formats).

``GUIDANCE`` and ``GUIDANCE_REFUSED`` were measured the same way on llguidance (1.9.1, ``lenient`` off, so it
refuses at compile what it does not implement): it enforces every form above, and ``allOf`` with several
branches, ``$ref`` / ``anyOf`` beside other keywords, ``required`` of undeclared names, ``multipleOf`` on any
number, ``pattern`` with lengths, type-specific keywords without ``type``, ``patternProperties`` of any shape and
``$anchor``; it does not enforce the keywords of ``GUIDANCE_REFUSED``.

``REFUSED`` keywords (and any refused form) were accepted by xgrammar with the constraint ignored, or are draft-04 /
draft-07 spellings it misreads: a schema using one is refused by name and JSON path, never served with the keyword
silently dropped. ``ANNOTATIONS`` constrain nothing; a keyword in none of the tables is not JSON Schema's and is an
annotation by the specification.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, NamedTuple

#: Keywords that constrain nothing (annotations, identifiers, the dialect): accepted everywhere.
ANNOTATIONS: frozenset[str] = frozenset(
    {
        "$schema", "$id", "id", "$comment", "$vocabulary", "title", "description", "default", "examples",
        "deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType", "contentSchema",
    }
)  # fmt: skip

#: Keywords xgrammar enforces, in the forms the module docstring lists (verified by experiment).
XGRAMMAR: frozenset[str] = frozenset(
    {
        "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
        "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf", "patternProperties", "propertyNames",
        "maxProperties", "unevaluatedProperties", "unevaluatedItems", "$ref", "$defs", "definitions", "format",
    }
)  # fmt: skip

#: Keywords xgrammar does not enforce; the value says what it did with them.
REFUSED: dict[str, str] = {
    "not": "ignored",
    "if": "ignored",
    "then": "ignored",
    "else": "ignored",
    "dependentRequired": "ignored",
    "dependentSchemas": "ignored",
    "dependencies": "ignored (draft-07)",
    "uniqueItems": "ignored",
    "contains": "ignored",
    "minContains": "ignored",
    "maxContains": "ignored",
    "minProperties": "not enforced: duplicate keys count once",
    "$anchor": "references to anchors are not resolved",
    "$dynamicRef": "not resolved",
    "$dynamicAnchor": "not resolved",
    "$recursiveRef": "not resolved (draft 2019-09)",
    "$recursiveAnchor": "not resolved (draft 2019-09)",
    "additionalItems": "draft-07 array-form items are not supported",
}

#: ``format`` values whose xgrammar grammar every ``jsonschema`` format check passed (random walks, long strings
#: included; ``uri``, ``uri-reference`` and ``duration`` are checked by ``jsonschema`` with the packages of the
#: ``test`` extra: rfc3986-validator, isoduration). Refused: ``date``, ``date-time``, ``time`` (it writes year 0000
#: and second 60, which ``jsonschema`` rejects), ``ipv4`` (leading zeros: ``120.80.40.046``),
#: ``relative-json-pointer`` (``10123#``), ``hostname`` (labels over 63 characters), ``uri-template`` (values the
#: uri-template package rejects), and every other format (no grammar, or unverified).
XGRAMMAR_FORMATS: frozenset[str] = frozenset(
    {"email", "uuid", "ipv6", "json-pointer", "uri", "uri-reference", "duration"}
)

#: The JSON type a type-specific keyword applies to: xgrammar enforces it only when ``type`` names that type.
TYPED: dict[str, str] = {
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), "number"),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), "string"),
    **dict.fromkeys(("minItems", "maxItems", "unevaluatedItems"), "array"),
    **dict.fromkeys(("maxProperties", "patternProperties", "propertyNames", "unevaluatedProperties"), "object"),
}

#: The engines ``structured_outputs_backend`` chooses among; ``auto`` takes the first that enforces the schema.
BACKENDS = ("auto", "xgrammar", "guidance")

#: Keywords llguidance enforces (verified by experiment, see the module docstring).
GUIDANCE: frozenset[str] = frozenset(
    {
        "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
        "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf", "patternProperties", "maxProperties",
        "$ref", "$defs", "definitions", "$anchor", "format", "additionalItems",
    }
)  # fmt: skip

#: Keywords llguidance does not enforce; the value says what it did with them.
GUIDANCE_REFUSED: dict[str, str] = {
    **dict.fromkeys(
        ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "uniqueItems",
         "contains", "minContains", "maxContains", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
         "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor"),
        "llguidance: unimplemented",
    ),
    "minProperties": "llguidance: not enforced, duplicate keys count once",
}  # fmt: skip

#: ``format`` values llguidance enforces (every ``jsonschema`` check passed, as for ``XGRAMMAR_FORMATS``; its
#: ``date-time`` and ``time`` write second 60 and its ``date`` year 0000, which ``jsonschema`` rejects, its
#: ``hostname`` labels over 63 characters; it has no grammar for ``uri-reference``, ``uri-template``,
#: ``json-pointer`` and ``relative-json-pointer``).
GUIDANCE_FORMATS: frozenset[str] = frozenset({"email", "uuid", "ipv4", "ipv6", "uri", "duration"})

# Keywords whose value is one schema, a list of schemas, or a name -> schema map (walked into).
_ONE = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems", "not",
        "if", "then", "else", "contains", "additionalItems", "contentSchema")  # fmt: skip
_LIST = ("anyOf", "allOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: Keywords that may stand beside a combinator or ``$ref`` without xgrammar dropping them (they constrain nothing).
_INERT = ANNOTATIONS | {"$defs", "definitions"}


class UnsupportedSchemaError(ValueError):
    """A schema keyword (or form) the grammar engine does not enforce; the message names the keyword and its
    JSON path (``$.properties.a.not``)."""


def find_unsupported(
    schema: Any, path: str = "$", ignore_formats: bool = False, backend: str = "xgrammar"
) -> str | None:
    """The first keyword of ``schema`` ``backend`` (xgrammar or guidance) would not enforce, as
    ``"<path>: <keyword> ..."``, else None (``find_all_unsupported``'s first)."""
    found = find_all_unsupported(schema, path, ignore_formats, backend)
    return found[0] if found else None


def find_all_unsupported(
    schema: Any, path: str = "$", ignore_formats: bool = False, backend: str = "xgrammar"
) -> list[str]:
    """Every keyword of ``schema`` ``backend`` (xgrammar or guidance) would not enforce, each as
    ``"<path>: <keyword> ..."``, in document order (empty when it enforces them all).

    Walks every subschema (properties, items, combinator branches, ``$defs`` / ``definitions``, ...), so a keyword
    reached only through ``$ref`` is found where it is defined. Keywords in no table are passed (annotations, by
    the specification). The forms accepted are the module docstring's.

    Args:
        schema: a JSON schema (a dict, or a boolean schema).
        path: the JSON path of ``schema`` in the document, for the message.
        ignore_formats: pass ``format`` unchecked (the user accepts any string there).
        backend: ``"xgrammar"`` or ``"guidance"``.
    """
    found: list[str] = []
    _collect(schema, path, _Options(ignore_formats, backend, draft_of(schema)), found)
    return found


class _Options(NamedTuple):
    ignore_formats: bool
    backend: str
    #: the document's draft (``draft_of``): a ``const`` in a draft-04 document is an annotation, so it cannot make
    #: ``oneOf`` branches disjoint there (the engines still write the value: stricter, not wrong); array-form
    #: ``items`` / ``additionalItems`` and boolean exclusive bounds mean what they say only in the older drafts.
    draft: str


#: Drafts in which ``items`` may be an array (its tuple form) with ``additionalItems``; ``exclusiveMinimum`` /
#: ``exclusiveMaximum`` are booleans modifying ``minimum`` / ``maximum`` in draft-04 alone.
_TUPLE_ITEMS_DRAFTS = ("04", "06", "07")


def draft_of(schema: Any) -> str:
    """The JSON Schema draft a document declares in its ``$schema``: ``"04"``, ``"06"``, ``"07"``, ``"2019-09"``,
    or ``"2020-12"`` (also when it declares none or another: the specification's default)."""
    dialect = schema.get("$schema") if isinstance(schema, dict) else None
    if isinstance(dialect, str):
        found = re.search(r"draft-0([3-7])/|draft/(2019-09)/", dialect)
        if found:
            return f"0{found.group(1)}" if found.group(1) else "2019-09"
    return "2020-12"


def _collect(schema: Any, path: str, opts: _Options, found: list[str], root: bool = True) -> None:
    if not isinstance(schema, dict):
        return
    refusal = _refusal if opts.backend == "xgrammar" else _guidance_refusal
    for key, value in schema.items():
        where = f"{path}.{key}"
        reason = refusal(key, value, schema, opts)
        if not reason and not root and opts.backend == "xgrammar" and _sets_base_uri(key, value, opts.draft):
            reason = "in a subschema is not enforced (xgrammar resolves every reference from the document's root)"
        if reason:
            found.append(f"{where}: {key} {reason}")
        _walk_children(key, value, where, opts, found)


def _sets_base_uri(key: str, value: Any, draft: str) -> bool:
    """An ``$id`` (draft-04's ``id``) that moves the base URI its subschema's references resolve against (a bare
    ``#name`` only names an anchor)."""
    return (
        (key == "$id" or key == "id" and draft in ("03", "04")) and isinstance(value, str) and not value.startswith("#")
    )


def route(schema: Any, backend: str = "auto", ignore_formats: bool = False) -> str:
    """The engine that serves ``schema``: ``"xgrammar"`` or ``"guidance"``.

    ``auto`` takes xgrammar when it enforces every keyword of the schema, else llguidance when it does; a named
    backend takes only itself.

    Raises:
        UnsupportedSchemaError: naming every keyword (each with its JSON path) that the candidate engines would
            not enforce, each tagged with the engine (``[xgrammar]``, ``[llguidance]``); or every place where the
            schema is not a schema of its own draft (``malformed``: what its keywords mean is then undefined);
            ``ValueError`` for an unknown ``backend``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {BACKENDS}, got {backend!r}")
    bad = malformed(schema)
    if bad:
        raise UnsupportedSchemaError(f"JSON schema is not valid under its draft ({draft_of(schema)}), refused: "
                                     + "; ".join(bad))  # fmt: skip
    findings: list[str] = []
    for name in ("xgrammar", "guidance") if backend == "auto" else (backend,):
        found = find_all_unsupported(schema, ignore_formats=ignore_formats, backend=name)
        if not found:
            return name
        findings.extend(f"{f} [{'llguidance' if name == 'guidance' else name}]" for f in found)
    raise UnsupportedSchemaError(f"JSON schema keyword not enforced, refused: {'; '.join(findings)}")


def malformed(schema: Any) -> list[str]:
    """Every place where ``schema`` breaks its draft's metaschema (``jsonschema``'s check, formats such as a
    ``pattern``'s regex included), as ``"<path>: <keyword> <what is wrong>"``: draft-07's array ``items`` without a
    draft-07 ``$schema``, ``"required": true``, ``"type": "any"``, ... Empty when it is well formed, or when
    ``jsonschema`` is not installed (the engines then judge it alone)."""
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError):
        return [f"$: the schema is not JSON ({type(schema).__name__})"]
    return list(_malformed(text))


@functools.lru_cache(maxsize=256)
def _malformed(text: str) -> tuple[str, ...]:
    try:
        import jsonschema
    except ImportError:
        return ()
    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    found: dict[str, None] = {}
    for error in cls(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER).iter_errors(schema):
        keyword = next((str(p) for p in reversed(error.path) if isinstance(p, str)), "schema")
        found[f"{error.json_path}: {keyword} is malformed ({error.message[:200]})"] = None
    return tuple(found)


def check_schema(schema: Any, ignore_formats: bool = False, backend: str = "auto") -> None:
    """Raise ``UnsupportedSchemaError`` naming every keyword of ``schema`` (and its JSON path) that no engine
    ``backend`` allows would enforce (``route``)."""
    route(schema, backend, ignore_formats)


def without_formats(schema: Any, keep: frozenset[str] | None) -> Any:
    """``schema`` with every ``format`` whose value is not in ``keep`` removed (``ignore_formats``: an engine that
    refuses unknown formats then serves the rest; ``keep`` None keeps every format), and the keywords that
    constrain nothing (``uniqueItems: false``, ``minProperties: 0``, which llguidance refuses as unimplemented);
    walks subschemas only, never a ``properties`` map's names."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "format" and keep is not None and value not in keep or _constrains_nothing(key, value):
            continue
        if key in _ONE and not isinstance(value, list):
            value = without_formats(value, keep)
        elif (key in _LIST or key == "items") and isinstance(value, list):
            value = [without_formats(v, keep) for v in value]
        elif key in _MAP and isinstance(value, dict):
            value = {k: without_formats(v, keep) for k, v in value.items()}
        out[key] = value
    return out


def _constrains_nothing(key: str, value: Any) -> bool:
    return key == "uniqueItems" and value is False or key == "minProperties" and value == 0


def _guidance_refusal(key: str, value: Any, schema: dict, opts: _Options) -> str | None:
    """Why llguidance would not enforce ``key`` (with ``value``, in ``schema``), or None when it would."""
    if key in ANNOTATIONS or key not in GUIDANCE and key not in GUIDANCE_REFUSED:
        return None
    if key in GUIDANCE_REFUSED:
        if _constrains_nothing(key, value):
            return None
        return f"is not enforced ({GUIDANCE_REFUSED[key]})"
    if key == "oneOf" and not _disjoint(value, opts.draft not in ("03", "04")):
        return "is not enforced unless its branches are disjoint (a discriminator property with a distinct const)"
    if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
        return f"to {value!r} is not enforced (only references inside the schema)"
    if key == "items" and isinstance(value, list) and opts.draft not in _TUPLE_ITEMS_DRAFTS:
        return (
            "in array form (draft-07's tuple form) is not enforced without a draft-04/06/07 $schema (write prefixItems)"
        )
    if key == "additionalItems" and opts.draft not in _TUPLE_ITEMS_DRAFTS:
        return "(draft-07's) is not enforced without a draft-04/06/07 $schema"
    if key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool) and opts.draft != "04":
        return "as a boolean (draft-04's) is not enforced without a draft-04 $schema"
    if key == "format" and not opts.ignore_formats and value not in GUIDANCE_FORMATS:
        return f"{value!r} is not enforced"
    return None


def _refusal(key: str, value: Any, schema: dict, opts: _Options) -> str | None:
    """Why ``key`` (with ``value``, in ``schema``) is not enforced, or None when it is."""
    if key in ANNOTATIONS:
        return None
    if key in REFUSED:
        if _constrains_nothing(key, value):
            return None
        return f"is not enforced ({REFUSED[key]})"
    if key not in XGRAMMAR:
        return None
    if key in TYPED and not _names_type(schema.get("type"), TYPED[key]):
        if key == "format" and opts.ignore_formats:
            return None
        return f"is not enforced without a type naming {TYPED[key]!r}"
    return _form_refusal(key, value, schema, opts)


def _form_refusal(key: str, value: Any, schema: dict, opts: _Options) -> str | None:
    siblings = sorted(k for k in schema if k != key and k not in _INERT)
    if key in ("anyOf", "oneOf", "allOf", "$ref") and siblings:
        return f"is not enforced beside {', '.join(siblings)} (only the {key} would be)"
    if key == "allOf" and not (isinstance(value, list) and len(value) == 1):
        return "is not enforced with more than one branch"
    if key == "oneOf" and not _disjoint(value, opts.draft not in ("03", "04")):
        return "is not enforced unless its branches are disjoint (a discriminator property with a distinct const)"
    if key == "$ref" and not (isinstance(value, str) and (value == "#" or value.startswith("#/"))):
        return f"to {value!r} is not enforced (only '#' and '#/...' references)"
    if key == "items" and isinstance(value, list):
        return "in array form (draft-07) is not enforced"
    if key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
        return "as a boolean (draft-04) is not enforced"
    if key == "multipleOf":
        return _multiple_of_refusal(value, schema)
    if key in _BOUNDS and _names_type(schema.get("type"), "integer") and not _whole(value):
        return f"{value!r} is not enforced on integers (xgrammar takes whole-number bounds only)"
    if key == "pattern" and ("minLength" in schema or "maxLength" in schema):
        return "is not enforced together with minLength/maxLength (the lengths would be dropped)"
    if key == "pattern" and isinstance(value, str) and _matches_any_character(value):
        return f"{value!r} is not enforced: xgrammar's {_WILDCARD_NOTE}"
    if key in ("minLength", "maxLength") and "format" in schema and not opts.ignore_formats:
        return "is not enforced together with format (xgrammar drops the lengths)"
    if key == "required" and isinstance(value, list):
        declared = schema.get("properties", {})
        missing = [name for name in value if not isinstance(declared, dict) or name not in declared]
        if missing:
            names = ", ".join(repr(name) for name in missing)
            return (
                f"of {names} is not enforced: {'it is' if len(missing) == 1 else 'they are'} not declared in properties"
            )
    if key == "patternProperties":
        return _pattern_properties_refusal(value, schema)
    if key == "propertyNames" and schema.get("properties"):
        return "is not enforced beside properties"
    if key == "format" and not opts.ignore_formats and value not in XGRAMMAR_FORMATS:
        return f"{value!r} is not enforced"
    if key in ("enum", "const"):
        return _values_refusal(key, value, schema)
    return None


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
#: xgrammar 0.2.9 drops an integer ``multipleOf`` above this, or with bounds spanning more than
#: ``_MULTIPLE_OF_RANGE`` (or bounded on one side only): ``cpp/json_schema_converter.cc``, ``ParseInteger``.
_MULTIPLE_OF_MAX = 1024
_MULTIPLE_OF_RANGE = 10000


def _whole(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()


def _multiple_of_refusal(value: Any, schema: dict) -> str | None:
    """xgrammar enforces ``multipleOf`` only on ``type: integer``, a whole number up to 1024, with no bounds or a
    lower and an upper bound less than 10000 apart (it drops it otherwise, with a warning)."""
    if schema.get("type") != "integer":
        return "is not enforced on non-integer numbers"
    if not _whole(value) or not 0 < value <= _MULTIPLE_OF_MAX:
        return f"{value!r} is not enforced (xgrammar takes whole numbers up to {_MULTIPLE_OF_MAX})"
    low = [v + (k == "exclusiveMinimum") for k, v in schema.items() if k in ("minimum", "exclusiveMinimum")]
    high = [v - (k == "exclusiveMaximum") for k, v in schema.items() if k in ("maximum", "exclusiveMaximum")]
    if not low and not high:
        return None
    if not (low and high) or not all(_whole(v) for v in low + high) or min(high) - max(low) > _MULTIPLE_OF_RANGE:
        return f"is not enforced beside bounds unless both are set and under {_MULTIPLE_OF_RANGE} apart"
    return None


def _names_type(type_: Any, wanted: str) -> bool:
    names = type_ if isinstance(type_, list) else [type_]
    return wanted in names or wanted == "number" and "integer" in names


_WILDCARD_NOTE = "'.', negated classes and \\W \\S \\D also match UTF-8-encoded surrogates, which no JSON text holds"


def _matches_any_character(pattern: str) -> bool:
    """Whether ``pattern`` has a construct that matches characters outside a listed set: an unescaped ``.``, a
    negated class ``[^...]``, ``\\W``, ``\\S``, ``\\D``, ``\\P``, ``\\p``. xgrammar 0.2.9 compiles these to byte ranges
    that also take UTF-8-encoded surrogates (``\\xED\\xA0\\x80``), which decode to U+FFFD: found by
    ``benchmarks.schema_walk`` (``^.{2,4}$`` wrote three replacement characters for one "character")."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if i + 1 < len(pattern) and pattern[i + 1] in "WSDPp":
                return True
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "^":
                return True
            if pattern[i + 1 : i + 2] == "]":  # a leading "]" is a member
                i += 1
        elif c == ".":
            return True
        i += 1
    return False


def _pattern_properties_refusal(value: Any, schema: dict) -> str | None:
    if not isinstance(value, dict) or len(value) != 1:
        return "is not enforced with more than one pattern (a name matching two must satisfy both)"
    if schema.get("additionalProperties") not in (None, False):
        return "is not enforced beside additionalProperties"
    (pattern,) = value
    if _matches_any_character(pattern):
        return f"pattern {pattern!r} is not enforced: xgrammar's {_WILDCARD_NOTE}"
    try:
        clash = [name for name in schema.get("properties", {}) if re.search(pattern, name)]
    except re.error:
        return f"pattern {pattern!r} is not a regular expression this check reads"
    if clash:
        return f"is not enforced: its pattern matches the declared property {clash[0]!r} (duplicate keys)"
    return None


def _values_refusal(key: str, value: Any, schema: dict) -> str | None:
    """xgrammar writes one of the ``enum`` / ``const`` values and drops their siblings (a ``const`` beside an
    ``enum`` too): accepted when every value it may write satisfies the whole ``schema`` (checked with
    ``jsonschema``)."""
    rest = {k: v for k, v in schema.items() if k != key and k not in _INERT}
    values = value if key == "enum" and isinstance(value, list) else [value]
    if not rest:
        return None
    try:
        import jsonschema
    except ImportError:
        return "is not checked beside other keywords without jsonschema (pip install 'cbrun[structured]')"

    cls = jsonschema.validators.validator_for(schema)
    if "format" in rest and rest["format"] not in cls.FORMAT_CHECKER.checkers:
        return f"is not checked against format {rest['format']!r} here (pip install 'cbrun[structured]')"
    try:
        validator = cls(rest, format_checker=cls.FORMAT_CHECKER)
        bad = [v for v in values if not validator.is_valid(v)]
    except Exception:  # a $ref inside the siblings, a malformed sibling: not checkable here
        return "is not enforced beside keywords its values could not be checked against"
    if bad:
        return f"value {json.dumps(bad[0])} breaks the schema's other keywords (xgrammar would write it)"
    return None


def _walk_children(key: str, value: Any, where: str, opts: _Options, found: list[str]) -> None:
    if key == "propertyNames" and isinstance(value, dict) and "type" not in value:
        value = {"type": "string", **value}  # names are strings: their string keywords need no type
    if key in _ONE and not isinstance(value, list):
        _collect(value, where, opts, found, root=False)
    elif (key in _LIST or key == "items") and isinstance(value, list):  # items: draft-07's array form too
        for i, sub in enumerate(value):
            _collect(sub, f"{where}[{i}]", opts, found, root=False)
    elif key in _MAP and isinstance(value, dict):
        for name, sub in value.items():
            _collect(sub, f"{where}.{name}", opts, found, root=False)


def _disjoint(branches: Any, const: bool = True) -> bool:
    """True when no value can satisfy two of ``branches``: each a distinct ``const``, each a distinct single type
    (``integer`` and ``number`` overlap), or a property required in every branch with a distinct ``const`` (or
    one-value ``enum``) in each. ``const`` False: the document's draft has no ``const`` (draft-04), so only
    one-value enums count."""
    if not isinstance(branches, list) or not branches or not all(isinstance(b, dict) for b in branches):
        return False
    consts = [_single_value(b, const) for b in branches]
    if all(c is not None for c in consts) and len(set(consts)) == len(consts):
        return True
    types = [b.get("type") for b in branches]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types):
        return not {"integer", "number"} <= set(types)
    for name in sorted(branches[0].get("properties", {})):
        values = [_discriminator(b, name, const) for b in branches]
        if all(v is not None for v in values) and len(set(values)) == len(values):
            return True
    return False


def _discriminator(branch: dict, name: str, const: bool) -> str | None:
    prop = branch.get("properties", {}).get(name)
    if not isinstance(prop, dict) or name not in branch.get("required", []):
        return None
    return _single_value(prop, const)


def _single_value(schema: dict, const: bool = True) -> str | None:
    """The one value ``schema`` allows (``const`` or a one-value ``enum``), as canonical text (JSON equality:
    ``1`` and ``1.0`` are one value, ``true`` and ``1`` two), else None."""
    if const and "const" in schema:
        return json.dumps(_canonical(schema["const"]), sort_keys=True)
    if isinstance(schema.get("enum"), list) and len(schema["enum"]) == 1:
        return json.dumps(_canonical(schema["enum"][0]), sort_keys=True)
    return None


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value


def constraint_backend(params, config) -> str:
    """The engine that serves a request's constraint (``StructuredOutputsParams``) under an ``EngineConfig``:
    ``route`` of its JSON schema with ``structured_outputs_backend`` and ``structured_outputs_ignore_formats``.
    A regex, choice or grammar goes to llguidance when ``structured_outputs_backend = "guidance"`` (llguidance
    refuses at compile, by its message, the syntax it does not read), else to xgrammar.

    Raises:
        UnsupportedSchemaError: as ``route``; also when the constraint needs llguidance and it is not installed.
    """
    if params.kind == "json":
        backend = route(params.json_schema, config.structured_outputs_backend, config.structured_outputs_ignore_formats)
    else:
        backend = "guidance" if config.structured_outputs_backend == "guidance" else "xgrammar"
    if backend == "guidance":
        import importlib.util

        if importlib.util.find_spec("llguidance") is None:
            found = (
                find_all_unsupported(params.json_schema, ignore_formats=config.structured_outputs_ignore_formats)
                if params.kind == "json"
                else []
            )
            raise UnsupportedSchemaError(
                f"{'JSON schema' if params.kind == 'json' else params.kind} constraint needs llguidance, which is "
                "not installed (pip install 'cbrun[guidance]')"
                + (f"; xgrammar would not enforce {'; '.join(found)}" if found else "")
            )
    return backend


#: The forms in which xgrammar enforces a keyword (the rules ``_form_refusal`` checks), for the docs' table.
XGRAMMAR_NOTES: dict[str, str] = {
    **{k: f"only with a `type` naming {t}" for k, t in TYPED.items()},
    "required": "only names declared in `properties`",
    "multipleOf": "only with `type: integer`, a whole number up to 1024, unbounded or bounded on both sides "
    "less than 10000 apart",
    **dict.fromkeys(_BOUNDS, "with a `type` naming number or integer; a whole number under `type: integer`"),
    "exclusiveMinimum": "a number (not the draft-04 boolean) with a `type` naming number or integer; a whole "
    "number under `type: integer`",
    "exclusiveMaximum": "a number (not the draft-04 boolean) with a `type` naming number or integer; a whole "
    "number under `type: integer`",
    "pattern": "only with a `type` naming string, not with `minLength` / `maxLength`, and without `.`, negated "
    "classes, `\\W`, `\\S`, `\\D` (they take UTF-8-encoded surrogates)",
    "patternProperties": "one pattern (without `.`, negated classes, `\\W`, `\\S`, `\\D`), matching no declared "
    "property, no `additionalProperties`; `type` object",
    "anyOf": "nothing constraining beside it",
    "oneOf": "disjoint branches only (a distinct `const` discriminator, values or types), nothing beside it",
    "allOf": "one branch, nothing beside it",
    "$ref": "`#` or `#/...` only, nothing constraining beside it",
    "enum": "beside other keywords only when every value satisfies them",
    "const": "beside other keywords only when the value satisfies them",
    "propertyNames": "not with `properties`; `type` object",
    "items": "a schema (not the draft-07 array form)",
    "minLength": "not with `format`; `type` string",
    "maxLength": "not with `format`; `type` string",
    "format": "only " + ", ".join(f"`{f}`" for f in sorted(XGRAMMAR_FORMATS)) + "; `type` string",
}

#: The forms in which llguidance enforces a keyword, for the docs' table.
GUIDANCE_NOTES: dict[str, str] = {
    "oneOf": "disjoint branches only (served as anyOf)",
    "$ref": "references inside the schema only",
    "items": "a schema; the array form only under a draft-04/06/07 `$schema`",
    "additionalItems": "beside array-form `items`, under a draft-04/06/07 `$schema`",
    "exclusiveMinimum": "a number; a boolean only under a draft-04 `$schema`",
    "exclusiveMaximum": "a number; a boolean only under a draft-04 `$schema`",
    "maxProperties": "llguidance refuses it (an error row) unless every declared property is required",
    "format": "only " + ", ".join(f"`{f}`" for f in sorted(GUIDANCE_FORMATS)),
}


def keyword_table() -> str:
    """The Markdown table of every classified keyword and what each engine does with it (``docs/structured-outputs.md``
    holds it; ``tests/engine/test_schema_support.py`` checks the copy)."""

    def cell(keyword: str, enforced: frozenset[str], refused: dict[str, str], notes: dict[str, str]) -> str:
        if keyword in enforced:
            return f"enforced: {notes[keyword]}" if keyword in notes else "enforced"
        return f"refused ({refused.get(keyword, 'not implemented')})"

    keywords = sorted(XGRAMMAR | set(REFUSED) | GUIDANCE | set(GUIDANCE_REFUSED), key=lambda k: k.lstrip("$").lower())
    lines = ["| keyword | xgrammar | llguidance |", "|---|---|---|"]
    for k in keywords:
        xgrammar = cell(k, XGRAMMAR, REFUSED, XGRAMMAR_NOTES)
        lines.append(f"| `{k}` | {xgrammar} | {cell(k, GUIDANCE, GUIDANCE_REFUSED, GUIDANCE_NOTES)} |")
    lines.append(f"| {', '.join(f'`{k}`' for k in sorted(ANNOTATIONS))} | annotations: accepted | accepted |")
    return "\n".join(lines) + "\n"


TABLE_BEGIN = "<!-- keyword table: made by `python -m cbrun.engine.structured_output.schema_support --write` -->"
TABLE_END = "<!-- end of the keyword table -->"


def write_table(doc) -> None:
    """Rewrite ``keyword_table()`` between ``TABLE_BEGIN`` and ``TABLE_END`` in the Markdown file ``doc``."""
    from pathlib import Path

    text = Path(doc).read_text()
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    Path(doc).write_text(f"{head}{TABLE_BEGIN}\n{keyword_table()}{TABLE_END}{tail}")


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if sys.argv[1:] == ["--write"]:
        write_table(Path(__file__).resolve().parents[3] / "docs" / "structured-outputs.md")
    else:
        print(keyword_table(), end="")
