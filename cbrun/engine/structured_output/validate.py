"""Whether a finished output satisfies its constraint: the ``structured_output_valid`` output column."""

from __future__ import annotations

import functools
import json

from cbrun.engine.structured_output.params import StructuredOutputsParams


def is_valid_output(text: str | None, params: StructuredOutputsParams | None) -> bool | None:
    """True when ``text`` satisfies the constraint, False when it does not, None without a constraint or text.

    JSON (``json``, ``json_object``) is parsed strictly (``json.loads``: no raw control characters) and validated
    with ``jsonschema`` (the schema's own draft, formats checked where it has a checker); ``choice`` is a membership test; ``regex`` and ``grammar`` are
    matched in full by xgrammar, the dialect they were compiled in. A row cut by ``max_tokens`` or a stop string
    is checked as written, so it is usually False.
    """
    if params is None or text is None:
        return None
    kind, key = params.key
    if kind in ("json", "json_object"):
        return _valid_json(text, params.json_schema)
    if kind == "choice":
        return text in params.choice
    return _grammar_accepts(kind, key, text)


def _valid_json(text: str, schema) -> bool:
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(value)


def _grammar_accepts(kind: str, text_of_constraint: str, text: str) -> bool:
    matcher = _matcher(kind, text_of_constraint)
    matcher.reset()
    return matcher.accept_string(text) and matcher.is_terminated()


@functools.lru_cache(maxsize=64)
def _matcher(kind: str, text_of_constraint: str):
    """An xgrammar matcher over characters (an empty vocabulary): it ends where the grammar may end."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1, cache_enabled=False)
    compiled = (
        compiler.compile_regex(text_of_constraint)
        if kind == "regex"
        else compiler.compile_grammar(text_of_constraint)
        if "::=" in text_of_constraint
        else compiler.compile_lark(text_of_constraint)
    )
    return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
