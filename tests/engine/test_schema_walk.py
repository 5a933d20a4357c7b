"""Random schemas from the specification (``benchmarks.schema_walk``): every served schema's completions validate
under ``jsonschema``, or the schema is refused naming a keyword and its JSON path; and the leaks earlier walks found
stay refused (each with the instance the engine wrote).

The longer walk is ``PYTHONPATH=. python -m benchmarks.schema_walk`` (``benchmarks/results-schema-walk.md``).
"""

from __future__ import annotations

import json
import random
import re

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from benchmarks.schema_walk import check_schemas, is_valid_schema, random_schema  # noqa: E402
from cbrun.engine.structured_output.schema_support import find_all_unsupported, route  # noqa: E402
from tests.engine.test_schema_support import _grammar_accepts  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from cbrun.jobs.cli.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("walk") / "model", max_position_embeddings=512)


def test_generator_draws_valid_varied_schemas():
    rng = random.Random(5)
    schemas = [random_schema(rng) for _ in range(200)]
    valid = [s for s in schemas if is_valid_schema(s)]
    assert len(valid) >= 180
    text = json.dumps(valid)
    for keyword in ("anyOf", "oneOf", "allOf", "$ref", "format", "enum", "const", "pattern", "minimum",
                    "additionalProperties", "prefixItems", "definitions", "draft-04", "draft-07", "not"):  # fmt: skip
        assert f'"{keyword}' in text or keyword in text, keyword


def test_random_schemas_validate_at_stop_or_are_refused_by_name(model_dir):
    rng = random.Random(11)
    schemas = [s for s in (random_schema(rng) for _ in range(36)) if is_valid_schema(s)]
    results = check_schemas(schemas, model_dir, walks=4, seed=11)
    served = {"xgrammar": 0, "guidance": 0}
    for schema, outcomes in zip(schemas, results):
        for backend, outcome in outcomes.items():
            assert not outcome.leaks, (backend, json.dumps(schema), outcome.leaks[:2])
            if outcome.refused is not None:
                assert re.search(r"\$[^ ]*: \$?\w+ ", outcome.refused), outcome.refused  # "$.a.b: keyword ..."
            elif outcome.error is None:
                served[backend] += 1
                assert outcome.completions or outcome.cut, (backend, schema)
    assert served["xgrammar"] >= 8 and served["guidance"] >= 12, served  # the walk checks something


_INT = {"type": "integer", "minimum": 0, "maximum": 9}
_D4 = "http://json-schema.org/draft-04/schema#"

#: Leaks earlier walks found (schema, what the engine wrote, the keyword now refused for xgrammar).
FOUND: list[tuple[dict, object, str]] = [
    ({"type": "object", "enum": [None, 32]}, None, "enum"),  # a null value was taken for "none breaks"
    ({"enum": ["a b", "QQ"], "const": False}, False, "const"),  # xgrammar writes the const, not in the enum
    ({"enum": [1, 2], "const": True}, True, "const"),  # true is not 1 in JSON Schema
    ({"oneOf": [{"const": 1}, {"const": 1.0}]}, 1, "oneOf"),  # 1 and 1.0 are one value: not disjoint
    ({"$schema": _D4, "oneOf": [{"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
                                {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}]},
     {"kind": "dog"}, "oneOf"),  # draft-04 has no const: both branches accept it
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, 7, "multipleOf"),  # one-sided bound: xgrammar drops it
    ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 20000}, 7, "multipleOf"),  # range over 10000
    ({"type": "integer", "multipleOf": 1.5}, 1, "multipleOf"),  # not a whole number: dropped
    ({"type": "string", "format": "email", "maxLength": 5}, "abc@example.com", "maxLength"),  # lengths dropped
    ({"$defs": {"X": {"type": "boolean"}, "sub": {"$id": "http://x.test/other.json", "$defs": {"X": {"type": "null"}},
      "type": "object", "properties": {"p": {"$ref": "#/$defs/X"}}, "required": ["p"], "additionalProperties": False}},
      "$ref": "#/$defs/sub"}, {"p": True}, "$id"),  # xgrammar resolves the reference from the root
]  # fmt: skip


@pytest.mark.parametrize(
    ("schema", "path"),
    [({"type": "array", "items": [_INT]}, "$.items: items"), ({"properties": {"a": {"required": True}}},
      "$.properties.a.required: required"), ({"type": "any"}, "$.type: type"),
     ({"type": "string", "pattern": "(["}, "$.pattern: pattern")],
)  # fmt: skip
def test_schemas_malformed_under_their_draft_are_refused_by_place(schema: dict, path: str) -> None:
    with pytest.raises(ValueError, match=re.escape(path) + " is malformed"):
        route(schema)


@pytest.mark.parametrize("case", range(len(FOUND)))
def test_leaks_found_by_the_walk_stay_refused(case: int) -> None:
    schema, written, keyword = FOUND[case]
    cls = jsonschema.validators.validator_for(schema)
    assert not cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(written)  # it really breaks the schema
    assert _grammar_accepts(schema, json.dumps(written, separators=(", ", ": ")))  # and xgrammar would write it
    assert any(f": {keyword} " in found for found in find_all_unsupported(schema)), find_all_unsupported(schema)
    backend = None
    try:
        backend = route(schema)
    except ValueError:
        pass
    assert backend != "xgrammar"


def test_keywords_that_constrain_nothing_are_served_by_both(model_dir):
    """``uniqueItems: false`` and ``minProperties: 0`` (llguidance refuses them as unimplemented) are left out."""
    schemas = [
        {"type": "array", "items": _INT, "uniqueItems": False, "maxItems": 2},
        {"type": "object", "properties": {"a": _INT}, "minProperties": 0, "additionalProperties": False},
    ]
    for outcomes in check_schemas(schemas, model_dir, walks=3, rows=False):
        for backend, outcome in outcomes.items():
            assert outcome.refused is None and outcome.error is None, (backend, outcome)
            assert outcome.completions and not outcome.leaks


def test_xgrammar_pattern_wildcards_take_surrogates_and_are_refused(model_dir):
    """xgrammar's ``.`` in a ``pattern`` takes a UTF-8-encoded surrogate (three bytes that decode to three U+FFFD, so
    the output breaks ``^.{2,4}$``): refused for xgrammar, served by llguidance, which keeps to valid UTF-8."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from cbrun.engine.structured_output import StructuredOutputsParams
    from cbrun.engine.structured_output.compiler import GrammarCompiler
    from cbrun.engine.structured_output.request_state import StructuredOutputRequest

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    schema = {"type": "string", "pattern": "^.{2,4}$"}
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    params = StructuredOutputsParams(json=schema)
    symbol = bytes_to_unicode()
    written = b'"\xed\xa0\x80ab"'
    for backend, accepts in (("xgrammar", True), ("guidance", False)):
        future = compiler.submit(params, backend)
        future.result()
        state = StructuredOutputRequest(params, future)
        assert state.ready() and state.error is None
        ids = tokenizer.convert_tokens_to_ids([symbol[b] for b in written])
        assert all(state.accept(t) for t in ids) is accepts, backend
    assert not jsonschema.Draft202012Validator(schema).is_valid(written.decode("utf-8", "replace")[1:-1])
    assert "$.pattern: pattern '^.{2,4}$' is not enforced" in find_all_unsupported(schema)[0]
    assert route(schema) == "guidance"
