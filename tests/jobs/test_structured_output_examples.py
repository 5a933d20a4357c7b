"""The structured-output examples the docs show (README.md and docs/*.md): every constraint in a ``toml`` block
under ``[sampling.structured_outputs]``, the commented alternatives included, parses as TOML and compiles with
xgrammar (over a vocabulary of single characters), so a user who copies one gets a working constraint."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from cbrun.engine.sampling_params import SamplingParams
from cbrun.engine.structured_output.compiler import _compile_with

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HEADER = "[sampling.structured_outputs]"
#: A line that starts a constraint (``json = ...``, or ``# regex = ...`` for an alternative); any other line
#: continues the one above (a multi-line ``'''`` string).
_KEY = re.compile(r"^(# )?(\w+) = ")


def _alternatives(block: str) -> list[str]:
    """Each constraint of one block under ``HEADER``, uncommented, as its own TOML text (lines before it skipped)."""
    lines = block.split(HEADER, 1)[1].splitlines()
    groups: list[list[str]] = []
    for line in (line for line in lines if line.strip()):
        if _KEY.match(line):
            groups.append([])
        assert groups, f"a line before any constraint: {line!r}"
        groups[-1].append(line.removeprefix("# "))
    return ["\n".join(group) for group in groups]


def _examples() -> list[str]:
    blocks = [b for page in PAGES for b in re.findall(r"```toml\n(.*?)```", page.read_text(), flags=re.S)]
    return [alt for block in blocks if HEADER in block.splitlines() for alt in _alternatives(block)]


def test_each_structured_output_kind_in_the_docs_is_a_valid_constraint():
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(c) for c in range(32, 127)] + ["</s>"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1]))
    examples = _examples()
    kinds = set()
    for example in examples:
        table = tomllib.loads(f"{HEADER}\n{example}\n")["sampling"]
        params = SamplingParams(structured_outputs=table["structured_outputs"])
        params.validate()
        kind, text = params.structured_outputs.key
        kinds.add(kind)
        assert _compile_with(compiler, kind, text) is not None, example
    assert kinds == {"choice", "grammar", "json", "json_object", "regex"}, examples
