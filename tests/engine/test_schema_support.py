"""The keyword table in ``schema_support`` against the installed xgrammar, with ``jsonschema`` as the judge.

Per accepted keyword: random walks through its grammar (compiled as the engine compiles it, over a character
vocabulary) and a tiny random model's greedy and sampled completions all validate. Per refused keyword or form:
xgrammar's grammar accepts an instance the schema forbids (so serving it would lie), and the walker refuses it by
name and JSON path.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from cbrun.engine.structured_output import StructuredOutputsParams, coerce_structured_outputs
from cbrun.engine.structured_output.schema_support import (
    ANNOTATIONS,
    REFUSED,
    XGRAMMAR,
    XGRAMMAR_FORMATS,
    UnsupportedSchemaError,
    check_schema,
    find_all_unsupported,
    find_unsupported,
)

xgr = pytest.importorskip("xgrammar")

_INT = {"type": "integer", "minimum": 0, "maximum": 9}
_OBJ = {"type": "object", "properties": {"a": _INT, "b": _INT}}
_CAT = {"type": "object", "properties": {"kind": {"const": "cat"}, "n": _INT}, "required": ["kind"]}
_DOG = {"type": "object", "properties": {"kind": {"enum": ["dog"]}, "ok": {"type": "boolean"}}, "required": ["kind"]}

#: keyword -> a schema using it that the walker accepts (bounded, so a random model closes it in 120 tokens).
ENFORCED: dict[str, dict] = {
    "type": {"type": ["integer", "null"], "minimum": 0, "maximum": 99},
    "enum": {"type": "string", "enum": ["red", "green"]},
    "const": {"const": {"x": [1, "y"]}},
    "properties": {"properties": {"a": _INT}, "required": ["a"], "additionalProperties": False},
    "required": {**_OBJ, "required": ["a", "b"]},
    "additionalProperties": {"type": "object", "additionalProperties": {"type": "boolean"}, "maxProperties": 2,
                             "propertyNames": {"maxLength": 2}},
    "items": {"type": "array", "items": _INT, "maxItems": 3},
    "prefixItems": {"type": "array", "prefixItems": [_INT, {"type": "boolean"}], "items": False},
    "minItems": {"type": "array", "items": _INT, "minItems": 2, "maxItems": 3},
    "maxItems": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    "minLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "maxLength": {"type": "string", "maxLength": 3},
    "pattern": {"type": "string", "pattern": "^a[bc]{1,4}$"},
    "minimum": {"type": "number", "minimum": -1.5, "maximum": 2.25},
    "maximum": {"type": "integer", "minimum": -3, "maximum": 5},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "exclusiveMaximum": {"type": "integer", "exclusiveMinimum": -2, "exclusiveMaximum": 5},
    "multipleOf": {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 100},
    "anyOf": {"anyOf": [_INT, {"type": "boolean"}, {"type": "null"}], "title": "t"},
    "oneOf": {"oneOf": [_CAT, _DOG]},
    "allOf": {"allOf": [{**_OBJ, "required": ["a"]}]},
    "patternProperties": {"type": "object", "patternProperties": {"^x[a-z]?$": _INT}, "maxProperties": 2},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^x"}, "additionalProperties": _INT,
                      "maxProperties": 2},
    "maxProperties": {"type": "object", "additionalProperties": _INT, "maxProperties": 1},
    "unevaluatedProperties": {**_OBJ, "unevaluatedProperties": False},
    "unevaluatedItems": {"type": "array", "prefixItems": [_INT], "unevaluatedItems": {"type": "boolean"},
                         "maxItems": 3},
    "$ref": {"$defs": {"n": {"type": "object", "properties": {"v": _INT, "k": {"type": "array", "maxItems": 1,
             "items": {"$ref": "#/$defs/n"}}}, "required": ["v"]}}, "$ref": "#/$defs/n"},
    "$defs": {"$defs": {"a/b": _INT}, "type": "object", "properties": {"p": {"$ref": "#/$defs/a~1b"}},
              "required": ["p"]},
    "definitions": {"definitions": {"x": {"type": "boolean"}}, "$ref": "#/definitions/x"},
    "format": {"type": "string", "format": "uuid"},
}  # fmt: skip

#: keyword (or refused form) -> (a schema using it, a compact instance it forbids that xgrammar's grammar accepts).
LEAKS: dict[str, tuple[dict, str]] = {
    "not": ({"not": {"type": "integer"}}, "1"),
    "if": ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 3}}, "7"),
    "then": ({"type": "integer", "then": {"maximum": 3}, "if": {"minimum": 5}}, "7"),
    "else": ({"type": "integer", "else": {"maximum": 3}, "if": {"minimum": 5}}, "4"),
    "dependentRequired": ({**_OBJ, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({**_OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    "dependencies": (
        {"$schema": "http://json-schema.org/draft-07/schema#", **_OBJ, "dependencies": {"a": ["b"]}},
        '{"a": 1}',
    ),
    "uniqueItems": ({"type": "array", "items": _INT, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": _INT, "contains": {"const": 5}}, "[1]"),
    "minContains": ({"type": "array", "items": _INT, "minContains": 2, "contains": {"const": 5}}, "[6, 8]"),
    "maxContains": ({"type": "array", "items": _INT, "maxContains": 1, "contains": {"const": 5}}, "[6, 8]"),
    "minProperties": ({"type": "object", "minProperties": 2, "additionalProperties": _INT}, '{"a": 1, "a": 2}'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    "allOf": ({"allOf": [{**_OBJ, "required": ["a"]}, {**_OBJ, "required": ["b"]}]}, '{"a": 1}'),
    "anyOf beside": ({**_OBJ, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "[true]"),
    "allOf beside": ({"type": "integer", "maximum": 3, "allOf": [{"minimum": 1}]}, "[true]"),
    "$ref beside": ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "maximum": 3}, "126"),
    "required undeclared": ({"type": "object", "required": ["a"]}, "{}"),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "7.8"),
    "pattern": ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcdef"'),
    "minimum": ({"minimum": 3}, "1"),
    "maxItems": ({"maxItems": 1}, "[1, 2]"),
    "enum": ({"type": "string", "enum": ["abc", 1]}, "1"),
    "patternProperties": ({**_OBJ, "patternProperties": {"^a": {"type": "boolean"}}}, '{"a": 2, "a": true}'),
    "propertyNames": ({"type": "object", "properties": {"yy": _INT}, "propertyNames": {"pattern": "^x"}}, '{"yy": 1}'),
    "format": ({"type": "string", "format": "date"}, '"2492-02-31"'),
}

#: Refused without a leaking instance to show: xgrammar rejects or cannot resolve them, and we name them first.
REFUSED_ONLY: dict[str, dict] = {
    "$anchor": {"$defs": {"x": {"$anchor": "X", "type": "integer"}}, "$ref": "#X"},
    "$dynamicRef": {"type": "array", "items": {"$dynamicRef": "#n"}, "$dynamicAnchor": "n"},
    "$dynamicAnchor": {"$dynamicAnchor": "n", "type": "integer"},
    "$recursiveRef": {"type": "array", "items": {"$recursiveRef": "#"}, "$recursiveAnchor": True},
    "$recursiveAnchor": {"$recursiveAnchor": True, "type": "integer"},
    "additionalItems": {"type": "array", "additionalItems": False, "items": [_INT]},
    "items": {"type": "array", "items": [_INT]},  # draft-07 array form
    "exclusiveMinimum": {"type": "integer", "minimum": 5, "exclusiveMinimum": True},  # draft-04 boolean
    "$ref": {"$ref": "other.json#/x"},
}

_VOCAB = [chr(c) for c in range(32, 127)] + ["é", "\u2603", '"a"', '": ', ", ", '{"', "12", "true", "null"]
_STOP = len(_VOCAB)


def _compiled(schema: dict):
    from cbrun.engine.structured_output.compiler import _compile_with

    info = xgr.TokenizerInfo([*_VOCAB, "</s>"], vocab_type=xgr.VocabType.RAW, stop_token_ids=[_STOP])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return _compile_with(compiler, "json", json.dumps(schema)), info.vocab_size


def random_walks(schema: dict, n: int = 30, max_len: int = 120, seed: int = 0, stop: float = 0.3) -> list[str]:
    """``n`` completions of ``schema``'s grammar, each token drawn uniformly from those its mask allows (the stop
    token with probability ``stop`` where allowed, else as any other); walks cut at ``max_len`` are dropped."""
    compiled, vocab = _compiled(schema)
    rng = random.Random(seed)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    shifts = torch.arange(32, dtype=torch.int32)
    done = []
    for _ in range(n):
        matcher, text = xgr.GrammarMatcher(compiled), []
        for _ in range(max_len):
            matcher.fill_next_token_bitmask(bitmask, 0)
            allowed = torch.nonzero(((bitmask[0, :, None] >> shifts) & 1).flatten()[:vocab]).flatten().tolist()
            token = _STOP if _STOP in allowed and rng.random() < stop else rng.choice(allowed)
            assert matcher.accept_token(token)
            if token == _STOP:
                break
            text.append(_VOCAB[token])
        if matcher.is_terminated():
            done.append("".join(text))
    return done


def validator(schema):
    """``jsonschema``'s validator of the schema's own draft, formats checked."""
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _grammar_accepts(schema: dict, text: str) -> bool:
    compiled, _ = _compiled(schema)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_every_keyword_is_classified():
    assert not XGRAMMAR & set(REFUSED) and not XGRAMMAR & ANNOTATIONS and not ANNOTATIONS & set(REFUSED)
    assert set(ENFORCED) == XGRAMMAR
    assert set(REFUSED) <= {case.split()[0] for case in LEAKS} | set(REFUSED_ONLY)


@pytest.mark.parametrize("keyword", sorted(ENFORCED))
def test_enforced_keyword_walks_all_validate(keyword: str) -> None:
    schema = ENFORCED[keyword]
    assert find_unsupported(schema) is None
    check = validator(schema)
    outputs = random_walks(schema)
    assert len(outputs) >= 10, outputs
    bad = [o for o in outputs if not check.is_valid(json.loads(o))]
    assert not bad, f"xgrammar no longer enforces {keyword}: {bad[:3]}"


@pytest.mark.parametrize("case", sorted(LEAKS))
def test_refused_keyword_leaks_in_xgrammar_and_is_named(case: str) -> None:
    schema, bad = LEAKS[case]
    keyword = case.split()[0]
    assert not validator(schema).is_valid(json.loads(bad))  # the instance really breaks the schema
    assert _grammar_accepts(schema, bad), f"xgrammar now enforces {case}: accept it"
    found = find_unsupported(schema)
    assert found is not None and f": {keyword} " in found, found


@pytest.mark.parametrize("keyword", sorted(REFUSED_ONLY))
def test_unresolvable_keyword_is_named(keyword: str) -> None:
    found = find_unsupported(REFUSED_ONLY[keyword])
    assert found is not None and f": {keyword} " in found, found


def checked_format(fmt: str):
    """``jsonschema``'s validator of a string of format ``fmt``; the test is skipped where the installed
    ``jsonschema`` has no checker for it (its format packages are in the ``test`` extra)."""
    schema = {"type": "string", "format": fmt}
    check = validator(schema)
    if fmt not in check.FORMAT_CHECKER.checkers:
        pytest.skip(f"jsonschema cannot check format {fmt!r} here (pip install -e '.[test]')")
    return schema, check


@pytest.mark.parametrize("fmt", sorted(XGRAMMAR_FORMATS))
def test_enforced_formats_validate(fmt: str) -> None:
    schema, check = checked_format(fmt)
    outputs = random_walks(schema, n=20) + random_walks(schema, n=10, max_len=300, seed=1, stop=0.0)
    assert len(outputs) >= 15 and all(check.is_valid(json.loads(o)) for o in outputs), outputs


@pytest.mark.parametrize(("fmt", "bad"), [("hostname", "a" * 64), ("ipv4", "120.80.40.046"), ("date", "2492-02-31")])
def test_refused_formats_leak_in_xgrammar(fmt: str, bad: str) -> None:
    schema, check = checked_format(fmt)
    assert not check.is_valid(bad) and _grammar_accepts(schema, json.dumps(bad))
    assert f"format {fmt!r} is not enforced" in find_unsupported(schema)


def test_unverified_formats_refused_unless_ignored():
    schema = {"type": "object", "properties": {"u": {"type": "string", "format": "uri-template"}}}
    assert find_unsupported(schema).startswith("$.properties.u.format: format 'uri-template' is not enforced")
    assert find_unsupported(schema, ignore_formats=True) is None


def test_path_names_the_place():
    schema = {"type": "object", "properties": {"a": {"not": {"type": "null"}}}}
    assert find_unsupported(schema).startswith("$.properties.a.not: not is not enforced")
    nested = {"$defs": {"x": {"anyOf": [{"type": "integer"}, {"if": {}}]}}, "$ref": "#/$defs/x"}
    assert find_unsupported(nested).startswith("$.$defs.x.anyOf[1].if: if")
    with pytest.raises(UnsupportedSchemaError, match=r"\$\.prefixItems\[0\]\.uniqueItems"):
        check_schema({"type": "array", "prefixItems": [{"type": "array", "uniqueItems": True}]})


def test_refusal_names_every_keyword_with_its_path():
    schema = {
        "type": "object",
        "properties": {"a": {"not": {"type": "null"}}, "b": {"type": "array", "items": _INT, "uniqueItems": True}},
        "required": ["a", "x", "y"],
    }
    with pytest.raises(UnsupportedSchemaError) as refused:
        check_schema(schema)
    message = str(refused.value)
    for found in ("$.properties.a.not: not", "$.properties.b.uniqueItems: uniqueItems"):
        assert f"{found} is not enforced (ignored) [xgrammar]" in message, message
        assert f"{found} is not enforced (llguidance: unimplemented) [llguidance]" in message, message
    assert "$.required: required of 'x', 'y' is not enforced" in message
    assert len(find_all_unsupported(schema)) == 3 and len(find_all_unsupported(schema, backend="guidance")) == 2


def test_checkable_forms_accepted():
    assert find_unsupported({"oneOf": [_CAT, _CAT]}) is not None  # the same discriminator twice
    assert find_unsupported({"oneOf": [{"const": 1}, {"const": 2}]}) is None
    assert find_unsupported({"oneOf": [{"type": "string"}, {"type": "null"}]}) is None
    assert find_unsupported({"type": "array", "uniqueItems": False, "items": _INT}) is None
    assert find_unsupported({"type": "integer", "enum": [1, 2], "maximum": 5}) is None
    assert "value 7" in find_unsupported({"type": "integer", "enum": [1, 7], "maximum": 5})


def test_params_refuse_by_keyword_and_path():
    with pytest.raises(ValueError, match=r"\$\.properties\.a\.not"):
        coerce_structured_outputs("structured_outputs", {"json": {"properties": {"a": {"not": {}}}}})
    with pytest.raises(ValueError, match="dependentRequired"):
        StructuredOutputsParams(json='{"dependentRequired": {"a": ["b"]}}').validate()


CONFIG = {"device": "cpu", "num_threads": 1, "page_size": 16, "max_batch_tokens": 1024, "max_requests_per_batch": 64}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from cbrun.jobs.cli.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("schemas") / "model", max_position_embeddings=512)


@pytest.fixture(scope="module")
def engine(model_dir):
    from cbrun.engine import LLMEngine
    from cbrun.engine.config import EngineConfig

    return LLMEngine.from_pretrained(str(model_dir), EngineConfig(**CONFIG))


def test_random_model_completions_validate_per_keyword(engine):
    """Each accepted keyword's schema, one greedy and two sampled rows: every ``stop`` completion validates, and
    every keyword has at least one."""
    from cbrun.engine.sampling_params import SamplingParams

    keywords = sorted(ENFORCED) + [f"format {f}" for f in sorted(XGRAMMAR_FORMATS)]
    schemas = [ENFORCED.get(k) or {"type": "string", "format": k.split()[1]} for k in keywords]
    requests = []
    for i, schema in enumerate(schemas):
        so = StructuredOutputsParams(json=schema)
        for j, temperature in enumerate((0.0, 1.0, 1.0)):
            params = SamplingParams(max_new_tokens=120, temperature=temperature, seed=i + j, structured_outputs=so)
            requests.append(((i, j), [256, 3 + i, 40 + j], params))
    stopped = {k: 0 for k in keywords}
    for output in engine.generate(requests):
        i, _ = output.request_id
        assert output.error is None, output.error
        if output.finish_reason == "stop":
            text = output.text or engine.tokenizer.decode(output.output_token_ids, skip_special_tokens=True)
            assert validator(schemas[i]).is_valid(json.loads(text)), (keywords[i], text)
            stopped[keywords[i]] += 1
    assert all(stopped.values()), stopped


# ---- llguidance -------------------------------------------------------------------------------------------------

#: Forms xgrammar leaks (``LEAKS``) that llguidance enforces: ``auto`` routes them there.
GUIDANCE_ONLY: dict[str, dict] = {
    "allOf": {"allOf": [{**_OBJ, "required": ["a"], "additionalProperties": False},
                        {"properties": {"a": {"maximum": 3}}, "required": ["b"]}]},
    "anyOf beside": {**_OBJ, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
    "$ref beside": {"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "maximum": 3, "minimum": 0},
    "required undeclared": {"type": "object", "required": ["a"], "additionalProperties": {"type": "boolean"}},
    "multipleOf": {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 10},
    "pattern": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
    "minimum": {"minimum": 3, "maximum": 50},
    "enum": {"type": "string", "enum": ["abc", 1]},
    "patternProperties": {**_OBJ, "patternProperties": {"^a": {"type": "boolean"}}},
    "$anchor": {"$defs": {"x": {"$anchor": "X", "type": "integer", "minimum": 0, "maximum": 3}}, "$ref": "#X"},
    "format": {"type": "string", "format": "ipv4"},
}  # fmt: skip

_DRAFT_07 = "http://json-schema.org/draft-07/schema#"
_DRAFT_04 = "http://json-schema.org/draft-04/schema#"

#: Forms of keywords whose ``ENFORCED`` example llguidance does not take (it refuses ``propertyNames``), and the
#: draft-07 / draft-04 forms it takes under their own ``$schema``.
GUIDANCE_FORMS: dict[str, dict] = {
    "additionalProperties": {**_OBJ, "required": ["a", "b"], "additionalProperties": {"type": "boolean"},
                             "maxProperties": 3},
    "items": {"$schema": _DRAFT_07, "type": "array", "items": [_INT, {"type": "boolean"}], "additionalItems": False},
    "additionalItems": {"$schema": _DRAFT_07, "type": "array", "items": [_INT], "additionalItems": {"type": "null"},
                        "maxItems": 3},
    "exclusiveMinimum": {"$schema": _DRAFT_04, "type": "integer", "minimum": 5, "exclusiveMinimum": True,
                         "maximum": 9},
    "exclusiveMaximum": {"$schema": _DRAFT_04, "type": "number", "minimum": 0.5, "exclusiveMinimum": True,
                         "maximum": 1, "exclusiveMaximum": True},
}  # fmt: skip

llguidance = pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def guidance_compiler(engine):
    from cbrun.engine.structured_output.compiler import GrammarCompiler

    vocab = engine.model.config.get_text_config().vocab_size
    return GrammarCompiler(engine.tokenizer, vocab, engine.eos_token_ids), vocab


def guidance_walks(compiler_and_vocab, schema: dict, n: int = 30, max_len: int = 120, seed: int = 0) -> list[str]:
    """As ``random_walks``, through llguidance (the engine's compile path and ``GuidanceMatcher``) over the demo
    model's tokenizer."""
    from cbrun.engine.structured_output.request_state import GuidanceMatcher

    compiler, vocab = compiler_and_vocab
    grammar = compiler.submit(StructuredOutputsParams(json=schema), "guidance").result()
    rng = random.Random(seed)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    shifts = torch.arange(32, dtype=torch.int32)
    eos = sorted(compiler._eos_token_ids)[0]
    done = []
    for _ in range(n):
        matcher, tokens = GuidanceMatcher(grammar), []
        for _ in range(max_len):
            matcher.fill_next_token_bitmask(bitmask, 0)
            allowed = torch.nonzero(((bitmask[0, :, None] >> shifts) & 1).flatten()[:vocab]).flatten().tolist()
            token = eos if eos in allowed and rng.random() < 0.3 else rng.choice(allowed)
            assert matcher.accept_token(token), matcher.matcher.get_error()
            if token != eos:
                tokens.append(token)
            if matcher.is_terminated():
                done.append(grammar.tokenizer.decode_bytes(tokens).decode())
                break
    return done


def _guidance_cases() -> dict[str, dict]:
    from cbrun.engine.structured_output.schema_support import GUIDANCE

    cases = {k: s for k, s in ENFORCED.items() if k in GUIDANCE and find_unsupported(s, backend="guidance") is None}
    cases.update({f"{k} (xgrammar leaks)": s for k, s in GUIDANCE_ONLY.items()})
    cases.update({f"{k} (llguidance form)": s for k, s in GUIDANCE_FORMS.items()})
    return cases


@pytest.mark.parametrize("case", sorted(_guidance_cases()))
def test_guidance_enforced_keyword_walks_all_validate(guidance_compiler, case: str) -> None:
    schema = _guidance_cases()[case]
    assert find_unsupported(schema, backend="guidance") is None
    check = validator(schema)
    outputs = guidance_walks(guidance_compiler, schema)
    assert len(outputs) >= 10, outputs
    bad = [o for o in outputs if not check.is_valid(json.loads(o))]
    assert not bad, f"llguidance does not enforce {case}: {bad[:3]}"


def test_guidance_keyword_table_covers_its_enforced_set():
    from cbrun.engine.structured_output.schema_support import GUIDANCE, GUIDANCE_REFUSED

    covered = {k.split()[0] for k in _guidance_cases()}
    assert GUIDANCE <= covered, GUIDANCE - covered
    assert not GUIDANCE & set(GUIDANCE_REFUSED)


@pytest.mark.parametrize("keyword", sorted(set(REFUSED) - {"$anchor"}))
def test_guidance_refused_keywords_are_named(guidance_compiler, keyword: str) -> None:
    """Every keyword both engines leave unenforced is refused by name for llguidance too; where llguidance
    implements none of it, its own compile refuses it as well."""
    from cbrun.engine.structured_output.compiler import GrammarCompileError

    schema = LEAKS[keyword][0] if keyword in LEAKS else REFUSED_ONLY[keyword]
    found = find_unsupported(schema, backend="guidance")
    assert found is not None and f": {keyword} " in found, found
    if keyword not in ("minProperties", "additionalItems", "oneOf"):  # llguidance serves these, loosely
        with pytest.raises(GrammarCompileError, match="llguidance"):
            guidance_compiler[0].submit(StructuredOutputsParams(json=schema), "guidance").result()


@pytest.mark.parametrize("keyword", ["items", "additionalItems", "exclusiveMinimum", "exclusiveMaximum"])
def test_draft_forms_go_to_llguidance_under_their_draft_only(keyword: str) -> None:
    from cbrun.engine.structured_output.schema_support import route

    schema = GUIDANCE_FORMS[keyword]
    assert route(schema) == "guidance"
    assert any(f": {keyword} " in f for f in find_all_unsupported(schema))  # xgrammar misreads the old forms
    undeclared = {k: v for k, v in schema.items() if k != "$schema"}  # malformed in 2020-12, or not its keyword
    with pytest.raises(UnsupportedSchemaError, match=rf": ({keyword}|items) (is malformed|[^;]*\[llguidance\])"):
        route(undeclared)


def test_route_auto_prefers_xgrammar_then_llguidance_then_refuses():
    from cbrun.engine.structured_output.schema_support import route

    assert route(ENFORCED["oneOf"]) == "xgrammar"
    assert route(GUIDANCE_ONLY["allOf"]) == "guidance"
    assert route(ENFORCED["propertyNames"]) == "xgrammar"
    with pytest.raises(UnsupportedSchemaError, match=r"\$\.properties\.a\.not: not .*\[xgrammar\].*\[llguidance\]"):
        route({"type": "object", "properties": {"a": {"not": {}}}})
    with pytest.raises(UnsupportedSchemaError, match="propertyNames"):
        route(ENFORCED["propertyNames"], "guidance")
    with pytest.raises(UnsupportedSchemaError, match="allOf"):
        route(GUIDANCE_ONLY["allOf"], "xgrammar")
    hostname = {"type": "string", "format": "hostname"}
    with pytest.raises(UnsupportedSchemaError, match="format 'hostname'"):
        route(hostname)
    assert route(hostname, ignore_formats=True) == "xgrammar"


def test_mixed_engines_in_one_batch_validate_and_agree(engine, model_dir):
    """One batch with xgrammar rows and llguidance rows (one bitmask, one apply per step), greedy and sampled:
    every completion validates; a schema both engines enforce gives the same greedy tokens through either."""
    from cbrun.engine import LLMEngine
    from cbrun.engine.config import EngineConfig
    from cbrun.engine.sampling_params import SamplingParams

    both = ENFORCED["required"]
    schemas = [both, GUIDANCE_ONLY["allOf"], GUIDANCE_ONLY["$ref beside"], ENFORCED["oneOf"], both]
    requests = []
    for i, schema in enumerate(schemas):
        for j, temperature in enumerate((0.0, 1.0)):
            so = StructuredOutputsParams(json=schema)
            params = SamplingParams(max_new_tokens=120, temperature=temperature, seed=i, structured_outputs=so)
            requests.append(((i, j), [256, 5 + i, 60 + j], params))
    outputs = {o.request_id: o for o in engine.generate(requests)}
    for (i, _), output in outputs.items():
        text = output.text or engine.tokenizer.decode(output.output_token_ids, skip_special_tokens=True)
        assert output.finish_reason == "stop", (i, output.error, text)
        assert validator(schemas[i]).is_valid(json.loads(text)), (i, text)
    keys = set(engine._grammar_compiler._cache)
    assert ("guidance", "json", json.dumps(GUIDANCE_ONLY["allOf"], separators=(",", ":"))) in keys
    assert ("xgrammar", "json", json.dumps(both, separators=(",", ":"))) in keys
    guided = LLMEngine.from_pretrained(str(model_dir), EngineConfig(**CONFIG, structured_outputs_backend="guidance"))
    only_xgrammar = SamplingParams(max_new_tokens=20, structured_outputs={"json": ENFORCED["propertyNames"]})
    again = {
        o.request_id: o for o in guided.generate([*[r for r in requests if r[0] == (0, 0)], (9, [256], only_xgrammar)])
    }
    assert again[(0, 0)].output_token_ids == outputs[(0, 0)].output_token_ids
    assert again[9].finish_reason == "error" and "$.propertyNames: propertyNames is not enforced" in again[9].error
    assert ("guidance", "json", json.dumps(both, separators=(",", ":"))) in guided._grammar_compiler._cache


@pytest.mark.parametrize("fmt", ["duration", "email", "ipv4", "ipv6", "uri", "uuid"])
def test_guidance_formats_validate(guidance_compiler, fmt: str) -> None:
    from cbrun.engine.structured_output.schema_support import GUIDANCE_FORMATS

    assert fmt in GUIDANCE_FORMATS
    schema, check = checked_format(fmt)
    outputs = guidance_walks(guidance_compiler, schema, n=20)
    assert outputs and all(check.is_valid(json.loads(o)) for o in outputs), outputs


def test_guidance_format_table_is_tested():
    from cbrun.engine.structured_output.schema_support import GUIDANCE_FORMATS

    marks = next(m for m in test_guidance_formats_validate.pytestmark if m.name == "parametrize")
    assert set(marks.args[1]) == GUIDANCE_FORMATS


def test_ignore_formats_serves_unknown_formats_unchecked(engine):
    from cbrun.engine.structured_output.compiler import GrammarCompileError, GrammarCompiler
    from cbrun.engine.structured_output.schema_support import route

    schema = {"allOf": [{"type": "object", "properties": {"u": {"type": "string", "format": "uri-template"}}}]}
    with pytest.raises(UnsupportedSchemaError, match=r"\$\.allOf\[0\]\.properties\.u\.format"):
        route(schema, "guidance")
    assert route(schema, "guidance", ignore_formats=True) == "guidance"
    vocab = engine.model.config.get_text_config().vocab_size
    so = StructuredOutputsParams(json=schema)
    strict = GrammarCompiler(engine.tokenizer, vocab, engine.eos_token_ids)
    with pytest.raises(GrammarCompileError, match="Unknown format"):  # llguidance refuses what it does not know
        strict.submit(so, "guidance").result()
    lenient = GrammarCompiler(engine.tokenizer, vocab, engine.eos_token_ids, ignore_formats=True)
    assert lenient.submit(so, "guidance").result().grammar


def test_docs_keyword_table_is_the_data():
    from pathlib import Path

    from cbrun.engine.structured_output.schema_support import TABLE_BEGIN, TABLE_END, keyword_table

    doc = (Path(__file__).resolve().parents[2] / "docs" / "structured-outputs.md").read_text()
    committed = doc.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].lstrip("\n")
    assert committed == keyword_table(), "run: python -m cbrun.engine.structured_output.schema_support --write"


def test_guidance_backend_serves_regex_choice_and_grammar(model_dir, engine):
    """With ``structured_outputs_backend = "guidance"`` a regex, a choice and a grammar (EBNF and Lark) are
    compiled by llguidance: the same greedy tokens as xgrammar's here, each valid; syntax llguidance cannot read is
    an error row with its message."""
    from cbrun.engine import LLMEngine
    from cbrun.engine.config import EngineConfig
    from cbrun.engine.sampling_params import SamplingParams
    from cbrun.engine.structured_output.validate import is_valid_output

    constraints = [
        {"regex": "[a-c]{2,5}x"},
        {"choice": ["yes", "no", 'ma"ybe']},
        {"grammar": 'root ::= "a" [0-9]+ "b"'},
        {"grammar": 'start: "q" NUM\nNUM: /[0-9]{1,3}/'},
    ]
    requests = [
        (i, [256, 5 + i], SamplingParams(max_new_tokens=60, structured_outputs=coerce_structured_outputs("so", c)))
        for i, c in enumerate(constraints)
    ]
    guided = LLMEngine.from_pretrained(str(model_dir), EngineConfig(**CONFIG, structured_outputs_backend="guidance"))
    bad = SamplingParams(max_new_tokens=8, structured_outputs={"regex": "(?<=a)b"})
    got = {o.request_id: o for o in guided.generate([*requests, (9, [256], bad)])}
    want = {o.request_id: o for o in engine.generate(requests)}
    for i, _, params in requests:
        assert got[i].finish_reason == "stop", got[i].error
        assert got[i].output_token_ids == want[i].output_token_ids
        assert is_valid_output(got[i].text, params.structured_outputs)
    assert got[9].finish_reason == "error" and "llguidance" in got[9].error
    assert {key[:2] for key in guided._grammar_compiler._cache} == {
        ("guidance", "regex"),
        ("guidance", "choice"),
        ("guidance", "grammar"),
    }


def test_guidance_batched_fill_matches_one_by_one_on_any_thread_count(guidance_compiler):
    """llguidance's rows filled together (its executor at two threads, a loop at one) equal each row's own mask."""
    from cbrun.engine.structured_output.request_state import StructuredOutputRequest, fill_bitmasks

    compiler, vocab = guidance_compiler
    states = []
    for i, schema in enumerate([GUIDANCE_ONLY["allOf"], GUIDANCE_ONLY["minimum"], ENFORCED["items"]] * 2):
        params = StructuredOutputsParams(json=schema)
        future = compiler.submit(params, "guidance")
        future.result()
        state = StructuredOutputRequest(params, future)
        assert state.ready() and state.error is None
        for token in [] if i < 3 else state.matcher.matcher.compute_ff_tokens()[:1]:
            assert state.accept(token)
        states.append(state)
    alone = xgr.allocate_token_bitmask(len(states), vocab)
    for row, state in enumerate(states):
        state.fill_bitmask(alone, row)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            together = xgr.allocate_token_bitmask(len(states) + 1, vocab)
            assert all(fill_bitmasks(states, together, list(range(1, len(states) + 1))))
            assert torch.equal(together[1:], alone), n
    finally:
        torch.set_num_threads(threads)
