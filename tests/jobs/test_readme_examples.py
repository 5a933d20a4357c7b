"""The README's structured-output example: every constraint kind it shows parses as TOML and compiles with
xgrammar (over a vocabulary of single characters), so the front door stays true."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from cbrun.engine.sampling_params import SamplingParams
from cbrun.engine.structured_output.compiler import _compile_with

README = Path(__file__).resolve().parents[2] / "README.md"


def test_each_structured_output_kind_in_the_readme_is_a_valid_constraint():
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(c) for c in range(32, 127)] + ["</s>"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1]))
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), flags=re.S)
    block = next(b for b in blocks if "[sampling.structured_outputs]" in b)
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    kinds = [line.removeprefix("# ") for line in lines[1:]]
    assert sorted(k.split(" = ")[0] for k in kinds) == ["choice", "grammar", "json", "regex"]
    for kind in kinds:
        table = tomllib.loads(f"[sampling.structured_outputs]\n{kind}\n")["sampling"]
        params = SamplingParams(structured_outputs=table["structured_outputs"])
        params.validate()
        assert _compile_with(compiler, *params.structured_outputs.key) is not None
