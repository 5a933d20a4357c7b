"""Random JSON schemas from the specification, through both grammar engines: every completion that ends with
``stop`` validates under ``jsonschema`` (format checker on), or the schema is refused by name.

The done-when of issue 45 ("on any corpus of schemas, every row either validates at stop or is an error row that
names the keyword"), checked property-style: ``random_schema`` draws random combinations and nestings of the
keywords of JSON Schema draft 2020-12 and the draft-07 / draft-04 spellings users still send (``definitions``,
``dependencies``, array-form ``items`` with ``additionalItems``, boolean ``exclusiveMinimum``), with ``$ref`` /
``$defs``, ``anyOf`` / ``oneOf`` / ``allOf`` / ``not`` / ``if``, formats, numeric and string bounds, enums and
consts, and object keywords. Each schema is checked under ``structured_outputs_backend`` ``xgrammar`` and
``guidance`` (``auto`` picks one of the two, so it is covered):

- refused (``route`` raises): the message must name a keyword with its JSON path (``$.…: keyword``);
- served: the grammar is compiled as the engine compiles it (``GrammarCompiler``), then ``--walks`` random walks
  through the engine's own matchers over the demo model's byte tokenizer (each token drawn among those the mask
  allows; every other walk favours closing bytes and EOS so values stay short, the rest draw uniformly and run
  longer) and a tiny random model's greedy and sampled rows
  (``LLMEngine.generate``); every completion whose matcher terminated must parse and validate. A compile error,
  or a mask that allows nothing, is an error row and is counted, never a leak.

A leak is printed with its schema and completion; each one found became a refusal (or a verified form) in
``cbrun.engine.structured_output.schema_support`` and a case in ``tests/engine/test_schema_walk.py``.

Run: ``PYTHONPATH=. python -m benchmarks.schema_walk [--schemas 400] [--seed 0] [--walks 8] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DRAFTS = {
    "2020-12": "https://json-schema.org/draft/2020-12/schema",
    "07": "http://json-schema.org/draft-07/schema#",
    "04": "http://json-schema.org/draft-04/schema#",
}
FORMATS = (
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "uri-template", "uuid", "json-pointer", "relative-json-pointer", "regex",
)  # fmt: skip
PATTERNS = ("^[a-z]{1,6}$", "^x", "[0-9]", "^(ab|cd)+$", "^\\d{3}-\\d{2}$", "^[A-Z][a-z]*$", "b$", "^.{2,4}$")
NAMES = ("a", "b", "id", "kind", "n", "name", "x1", "tags", "ok", "v")
TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A small random JSON value (for ``enum``, ``const``, ``default``)."""
    kind = rng.choice(("null", "bool", "int", "num", "str", "str", "int") + (("list", "obj") if depth < 2 else ()))
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.randint(-20, 120)
    if kind == "num":
        return rng.choice((0.5, -1.25, 3.75, 1e3, 2.0))
    if kind == "str":
        return rng.choice(("", "a", "red", "x-1", "héllo", "2024-01-02", "a b", "QQ"))
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 2))]
    return {rng.choice(NAMES): random_value(rng, depth + 1) for _ in range(rng.randint(0, 2))}


@dataclass
class _Ctx:
    rng: random.Random
    draft: str
    defs: dict[str, Any] = field(default_factory=dict)


def random_schema(rng: random.Random) -> dict:
    """A random schema document: a draft (mostly 2020-12, unnamed), maybe ``$defs`` / ``definitions`` that the body
    references with ``$ref``, and a body of random keywords nested up to three levels."""
    draft = rng.choices(("none", "2020-12", "07", "04"), (6, 1, 2, 1))[0]
    ctx = _Ctx(rng, "2020-12" if draft == "none" else draft)
    defs_key = "definitions" if ctx.draft in ("07", "04") or rng.random() < 0.2 else "$defs"
    if rng.random() < 0.3:  # definitions, each referring only to those before it (no reference cycles)
        for name in rng.sample(("node", "item", "pos"), rng.randint(1, 2)):
            ctx.defs[name] = _schema(ctx, 1, defs_key)
    if rng.random() < 0.08:  # a recursive definition, through an optional, bounded array (a tree)
        ctx.defs["tree"] = {
            "type": "object",
            "properties": {"v": _leaf(ctx), "kids": {"type": "array", "items": {"$ref": f"#/{defs_key}/tree"},
                                                      "maxItems": 2}},
            "required": ["v"],
            "additionalProperties": False,
        }  # fmt: skip
    body = _schema(ctx, 0, defs_key)
    if not isinstance(body, dict):
        body = {"allOf": [body]} if rng.random() < 0.5 else {"type": "boolean"}
    doc: dict[str, Any] = {}
    if draft != "none":
        doc["$schema"] = DRAFTS[draft]
    doc.update(body)
    if ctx.defs:
        doc[defs_key] = {**doc.get(defs_key, {}), **ctx.defs}
    return doc


def _schema(ctx: _Ctx, depth: int, defs_key: str) -> Any:
    rng = ctx.rng
    if depth >= 3 or rng.random() < 0.08 * depth:
        return _leaf(ctx)
    if rng.random() < 0.03:
        return rng.random() < 0.8  # a boolean schema
    roll = rng.random()
    if ctx.defs and roll < 0.12:
        ref = {"$ref": f"#/{defs_key}/{rng.choice(list(ctx.defs))}"}
        if rng.random() < 0.2:
            ref.update(_numeric(ctx) if rng.random() < 0.5 else {"description": "x"})
        return ref
    if roll < 0.3:
        return _combinator(ctx, depth, defs_key)
    kind = rng.choices(("object", "array", "string", "number", "other"), (4, 2, 3, 3, 2))[0]
    schema = {"object": _object, "array": _array, "string": _string, "number": _number, "other": _other}[kind](
        ctx, depth, defs_key
    )
    return _sprinkle(ctx, schema, depth, defs_key)


def _leaf(ctx: _Ctx) -> dict:
    rng = ctx.rng
    choice = rng.randrange(6)
    if choice == 0:
        return {"type": rng.choice(("null", "boolean"))}
    if choice == 1:
        return {"enum": [random_value(ctx.rng, 1) for _ in range(rng.randint(1, 3))]}
    if choice == 2:
        return {"const": random_value(ctx.rng, 1)}
    if choice == 3:
        return _string(ctx, 3, "$defs")
    return _number(ctx, 3, "$defs")


def _type(ctx: _Ctx, wanted: str) -> Any:
    """``wanted``, sometimes as a list with null, sometimes left out (type-specific keywords without ``type``)."""
    roll = ctx.rng.random()
    if roll < 0.1:
        return None
    if roll < 0.2:
        return [wanted, "null"]
    return wanted


def _typed(ctx: _Ctx, wanted: str, schema: dict) -> dict:
    type_ = _type(ctx, wanted)
    return schema if type_ is None else {"type": type_, **schema}


def _object(ctx: _Ctx, depth: int, defs_key: str) -> dict:
    rng = ctx.rng
    names = rng.sample(NAMES, rng.randint(0, 3))
    schema: dict[str, Any] = {}
    if names or rng.random() < 0.5:
        schema["properties"] = {n: _schema(ctx, depth + 1, defs_key) for n in names}
    if names and rng.random() < 0.7:
        schema["required"] = rng.sample(names, rng.randint(1, len(names)))
    if rng.random() < 0.1:
        schema.setdefault("required", []).append(rng.choice(NAMES))  # maybe undeclared
    roll = rng.random()
    if roll < 0.45:
        schema["additionalProperties"] = False
    elif roll < 0.6:
        schema["additionalProperties"] = _leaf(ctx)
    if rng.random() < 0.12:
        schema["patternProperties"] = {rng.choice(("^x", "^a", "^[0-9]+$")): _leaf(ctx)}
    if rng.random() < 0.08:
        schema["propertyNames"] = {"pattern": rng.choice(("^[a-z]+$", "^x")), "maxLength": 4}
    if rng.random() < 0.12:
        schema["maxProperties"] = rng.randint(0, 3)
    if rng.random() < 0.08:
        schema["minProperties"] = rng.randint(0, 2)
    if names and rng.random() < 0.06:
        key = "dependencies" if ctx.draft in ("07", "04") else "dependentRequired"
        schema[key] = {names[0]: [rng.choice(NAMES)]}
    if names and rng.random() < 0.04:
        schema["dependentSchemas"] = {names[0]: {"required": [rng.choice(NAMES)]}}
    if rng.random() < 0.05:
        schema["unevaluatedProperties"] = False
    return _typed(ctx, "object", schema)


def _array(ctx: _Ctx, depth: int, defs_key: str) -> dict:
    rng = ctx.rng
    schema: dict[str, Any] = {}
    roll = rng.random()
    if roll < 0.55:
        schema["items"] = _schema(ctx, depth + 1, defs_key)
    elif roll < 0.75:
        if ctx.draft in ("07", "04"):
            schema["items"] = [_leaf(ctx) for _ in range(rng.randint(1, 2))]
            if rng.random() < 0.6:
                schema["additionalItems"] = rng.random() < 0.3 and _leaf(ctx)
        else:
            schema["prefixItems"] = [_leaf(ctx) for _ in range(rng.randint(1, 2))]
            if rng.random() < 0.6:
                schema["items"] = rng.random() < 0.3 and _leaf(ctx)
    if rng.random() < 0.3:
        schema["minItems"] = rng.randint(0, 2)
    if rng.random() < 0.7:
        schema["maxItems"] = rng.randint(schema.get("minItems", 0), 4)
    if rng.random() < 0.08:
        schema["uniqueItems"] = rng.random() < 0.7
    if rng.random() < 0.06:
        schema["contains"] = _leaf(ctx)
        if rng.random() < 0.5:
            schema[rng.choice(("minContains", "maxContains"))] = rng.randint(0, 2)
    if rng.random() < 0.04:
        schema["unevaluatedItems"] = False
    return _typed(ctx, "array", schema)


def _string(ctx: _Ctx, depth: int, defs_key: str) -> dict:
    rng = ctx.rng
    schema: dict[str, Any] = {}
    roll = rng.random()
    if roll < 0.2:
        schema["format"] = rng.choice(FORMATS)
    elif roll < 0.4:
        schema["pattern"] = rng.choice(PATTERNS)
    if rng.random() < 0.3:
        schema["minLength"] = rng.randint(0, 3)
    if rng.random() < 0.6:
        schema["maxLength"] = rng.randint(schema.get("minLength", 0), 12)
    if rng.random() < 0.1:
        schema["enum"] = [rng.choice(("red", "green", "a", "xyz", "")) for _ in range(rng.randint(1, 3))]
    return _typed(ctx, "string", schema)


def _numeric(ctx: _Ctx) -> dict:
    rng = ctx.rng
    schema: dict[str, Any] = {}
    low, high = rng.randint(-50, 20), rng.randint(21, 200)
    if ctx.draft == "04" and rng.random() < 0.5:
        if rng.random() < 0.7:
            schema.update(minimum=low, exclusiveMinimum=rng.random() < 0.6)
        if rng.random() < 0.7:
            schema.update(maximum=high, exclusiveMaximum=rng.random() < 0.6)
        return schema
    for key, value in (("minimum", low), ("maximum", high), ("exclusiveMinimum", low - 1), ("exclusiveMaximum", high)):
        if rng.random() < 0.35:
            schema[key] = value if rng.random() < 0.8 else value + 0.5
    return schema


def _number(ctx: _Ctx, depth: int, defs_key: str) -> dict:
    rng = ctx.rng
    schema = _numeric(ctx)
    if rng.random() < 0.15:
        schema["multipleOf"] = rng.choice((2, 3, 5, 0.5, 0.25, 1.5))
    return _typed(ctx, rng.choice(("integer", "number")), schema)


def _other(ctx: _Ctx, depth: int, defs_key: str) -> dict:
    rng = ctx.rng
    roll = rng.random()
    if roll < 0.3:
        return {"enum": [random_value(rng) for _ in range(rng.randint(1, 4))]}
    if roll < 0.5:
        return {"const": random_value(rng)}
    if roll < 0.7:
        return {"type": rng.sample(TYPES[:5], rng.randint(1, 3))}
    return {"type": rng.choice(TYPES[:3])}


def _combinator(ctx: _Ctx, depth: int, defs_key: str) -> dict:
    rng = ctx.rng
    key = rng.choices(("anyOf", "oneOf", "allOf", "not", "if"), (4, 3, 3, 1, 1))[0]
    if key == "not":
        return {"not": _leaf(ctx)}
    if key == "if":
        schema = {"type": "integer", "if": {"minimum": 10}, "then": {"maximum": 50}}
        if rng.random() < 0.5:
            schema["else"] = {"minimum": -5}
        return schema
    if key == "oneOf" and rng.random() < 0.5:  # a discriminated union, as Pydantic writes one
        tags = rng.sample(("cat", "dog", "eel"), rng.randint(2, 3))
        branches = [
            {"type": "object", "properties": {"kind": {"const": t}, "n": _leaf(ctx)}, "required": ["kind"],
             "additionalProperties": rng.random() < 0.5}
            for t in tags
        ]  # fmt: skip
        return {"oneOf": branches}
    branches = [_schema(ctx, depth + 1, defs_key) for _ in range(rng.randint(1, 3))]
    schema: dict[str, Any] = {key: branches}
    if rng.random() < 0.2:
        schema.update(
            _typed(ctx, "object", {"required": [rng.choice(NAMES)]}) if rng.random() < 0.5 else {"title": "t"}
        )
    return schema


def _sprinkle(ctx: _Ctx, schema: dict, depth: int, defs_key: str) -> dict:
    """Occasional extra keywords: an ``enum`` / ``const`` beside the others, a ``not``, an annotation."""
    rng = ctx.rng
    roll = rng.random()
    if roll < 0.04:
        schema["const"] = random_value(rng, 1)
    elif roll < 0.08:
        schema["enum"] = [random_value(rng, 1) for _ in range(2)]
    elif roll < 0.1:
        schema["not"] = _leaf(ctx)
    elif roll < 0.2:
        schema[rng.choice(("description", "title", "default", "examples", "$comment"))] = "x"
    elif roll < 0.22 and depth:
        schema["$id"] = f"http://schemas.test/s{rng.randrange(100)}.json"  # moves its references' base URI
    return schema


# ---- the check ----------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One schema under one engine: refused (the message), served (its completions) or failed (an error row)."""

    backend: str
    refused: str | None = None
    error: str | None = None
    completions: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    cut: int = 0  # walks or rows that did not end (max length): not checked
    unjudged: int = 0  # completions jsonschema could not evaluate


def validator(schema: Any):
    """``jsonschema``'s validator for the schema's own draft, formats checked."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def is_valid_schema(schema: Any) -> bool:
    """Whether ``schema`` is a schema of its own draft (the generator's are meant to be; a few bounds may clash)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError:
        return False
    return True


def _closers(tokenizer) -> set[int]:
    return {i for i in range(len(tokenizer)) if tokenizer.decode([i]) in ('"', "}", "]", "0", "1")}


def walk(
    compiled_future, params, tokenizer, vocab: int, eos: int, rng: random.Random, max_len: int = 160, bias: bool = True
):
    """One random completion through the engine's matcher: ``(text, ended)``; ``text`` None when the mask allowed
    nothing (an error row in the engine). ``bias``: EOS and closing bytes favoured (short values); else every
    allowed token alike (long strings, many array items)."""
    import torch

    from cbrun.engine.structured_output.request_state import StructuredOutputRequest

    state = StructuredOutputRequest(params, compiled_future)
    assert state.ready() and state.error is None, state.error
    bitmask = torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    closers = _closers_cache.setdefault(id(tokenizer), _closers(tokenizer)) if bias else set()
    tokens: list[int] = []
    for _ in range(max_len):
        if not state.fill_bitmask(bitmask, 0):
            return None, False
        allowed = torch.nonzero(((bitmask[0, :, None] >> shifts) & 1).flatten()[:vocab]).flatten().tolist()
        roll = rng.random()
        if eos in allowed and (roll < 0.4 or not bias):
            token = eos
        elif roll < 0.7 and (near := [t for t in allowed if t in closers]):
            token = rng.choice(near)
        else:
            token = rng.choice(allowed)
        assert state.accept(token)
        if state.is_terminated:
            return tokenizer.decode(tokens, skip_special_tokens=True), True
        tokens.append(token)
    return tokenizer.decode(tokens, skip_special_tokens=True), False


_closers_cache: dict[int, set[int]] = {}


def check_schemas(schemas: list[dict], model_dir: Path, walks: int = 8, seed: int = 0, rows: bool = True):
    """Every schema under xgrammar and llguidance: a list (per schema) of ``{backend: Outcome}``.

    Walks go through each engine's own matchers; ``rows`` adds a greedy and a sampled row per served schema on the
    demo model (one ``generate`` per engine for all schemas).
    """
    from cbrun.engine import LLMEngine
    from cbrun.engine.config import EngineConfig
    from cbrun.engine.sampling_params import SamplingParams
    from cbrun.engine.structured_output import StructuredOutputsParams
    from cbrun.engine.structured_output.compiler import GrammarCompiler
    from cbrun.engine.structured_output.schema_support import UnsupportedSchemaError, route

    results: list[dict[str, Outcome]] = [{} for _ in schemas]
    config = {"device": "cpu", "num_threads": 1, "max_batch_tokens": 2048, "max_requests_per_batch": 128}
    for backend in ("xgrammar", "guidance"):
        engine = LLMEngine.from_pretrained(str(model_dir), EngineConfig(**config, structured_outputs_backend=backend))
        tokenizer = engine.tokenizer
        hf = tokenizer.transformers_tokenizer() if hasattr(tokenizer, "transformers_tokenizer") else tokenizer
        vocab = engine.model.config.get_text_config().vocab_size
        eos = sorted(engine.eos_token_ids)[0]
        compiler = GrammarCompiler(tokenizer, vocab, engine.eos_token_ids)
        requests = []
        for i, schema in enumerate(schemas):
            outcome = results[i][backend] = Outcome(backend)
            try:
                route(schema, backend)
            except UnsupportedSchemaError as refused:
                outcome.refused = str(refused)
                continue
            params = StructuredOutputsParams(json=schema)
            future = compiler.submit(params, backend)
            if future.exception() is not None:
                outcome.error = str(future.exception())
                continue
            rng = random.Random(seed * 7919 + i)
            for k in range(walks):
                text, ended = walk(future, params, hf, vocab, eos, rng, max_len=160 + 160 * (k % 2), bias=k % 2 == 0)
                if text is None:
                    outcome.error = "no token allowed"
                elif ended:
                    outcome.completions.append(text)
                else:
                    outcome.cut += 1
            if rows:
                for j, temperature in enumerate((0.0, 1.0)):
                    sp = SamplingParams(max_new_tokens=160, temperature=temperature, seed=i, structured_outputs=params)
                    requests.append(((i, j), [256, 3 + i % 200, 40 + j], sp))
        for output in engine.generate(requests) if requests else []:
            i, _ = output.request_id
            outcome = results[i][backend]
            if output.finish_reason == "stop":
                outcome.completions.append(
                    output.text or tokenizer.decode(output.output_token_ids, skip_special_tokens=True)
                )
            elif output.finish_reason == "error":
                outcome.error = output.error
            else:
                outcome.cut += 1
        compiler.shutdown()
    for schema, outcomes in zip(schemas, results):
        check = validator(schema)
        for outcome in outcomes.values():
            for text in outcome.completions:
                try:
                    ok = check.is_valid(json.loads(text))
                except ValueError:
                    ok = False
                except Exception:  # a schema jsonschema cannot evaluate (recursion, an unresolvable reference)
                    outcome.unjudged += 1
                    continue
                if not ok:
                    outcome.leaks.append(text)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemas", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--walks", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from cbrun.jobs.cli.demo import build_demo_model

    rng = random.Random(args.seed)
    schemas = [s for s in (random_schema(rng) for _ in range(args.schemas)) if is_valid_schema(s)]
    model_dir = build_demo_model(Path(tempfile.mkdtemp(prefix="cbrun-walk-")) / "model", max_position_embeddings=512)
    start = time.perf_counter()
    results = check_schemas(schemas, model_dir, args.walks, args.seed)
    report = _report(args, schemas, results, time.perf_counter() - start)
    print(report)
    if args.out is not None:
        args.out.write_text(report)
    return 1 if any(o.leaks for r in results for o in r.values()) else 0


def _report(args, schemas: list[dict], results: list[dict[str, Outcome]], seconds: float) -> str:
    import datetime

    from cbrun.bench.measure import git_commit

    lines = [
        f"# benchmarks.schema_walk ({datetime.date.today()}, commit {git_commit()})",
        "",
        f"`PYTHONPATH=. python -m benchmarks.schema_walk --schemas {args.schemas} --seed {args.seed} "
        f"--walks {args.walks}`: {len(schemas)} valid random schemas (of {args.schemas} drawn), each under both "
        f"engines: {args.walks} random walks through the engine's matcher and a greedy and a sampled row of the "
        f"demo model per served schema; {seconds:.0f} s.",
        "",
        "| engine | refused by name | served | error rows | completions checked | valid | leaks | cut (not ended) | "
        "not judged |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for backend in ("xgrammar", "guidance"):
        outs = [r[backend] for r in results]
        served = [o for o in outs if o.refused is None and o.error is None]
        checked = sum(len(o.completions) - o.unjudged for o in served)
        leaks = sum(len(o.leaks) for o in outs)
        lines.append(
            f"| {'llguidance' if backend == 'guidance' else backend} | {sum(o.refused is not None for o in outs)} | "
            f"{len(served)} | {sum(o.error is not None for o in outs)} | {checked} | {checked - leaks} | {leaks} | "
            f"{sum(o.cut for o in outs)} | {sum(o.unjudged for o in outs)} |"
        )
    lines.append("")
    for schema, outcomes in zip(schemas, results):
        for outcome in outcomes.values():
            if outcome.leaks:
                lines.append(f"- LEAK ({outcome.backend}): `{json.dumps(schema)}` wrote `{outcome.leaks[0]}`")
    errors = sorted(
        {(o.backend, " ".join((o.error or "").split())[:120]) for r in results for o in r.values() if o.error}
    )
    if errors:
        lines += [
            "",
            "Error rows (the engine's message, first 120 characters; each schema is unsatisfiable or names "
            "the keyword):",
            "",
        ]
        lines += [f"- {'llguidance' if b == 'guidance' else b}: {e}" for b, e in errors]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
