"""The model room's shape (``cbrun.engine.model.registry``): a family is one file plus one registry line. A family
defined here, in the test, and added to the registry's list is loaded without transformers and run by the engine
with no other change; and no module of the model room outside ``models/`` names a family's model_type,
architecture or tensor names."""

from __future__ import annotations

import ast
import json
import logging
import shutil
from pathlib import Path

from cbrun.engine import EngineConfig, SamplingParams
from cbrun.engine.model import registry
from cbrun.engine.model.models.llama import LlamaDecoderFamily
from cbrun.engine.model.safetensors_loader import load_plan
from tests.model_utils import random_model_dir, random_prompts, run_engine

MODEL_ROOM = Path(registry.__file__).parent


class TinyTestFamily(LlamaDecoderFamily):
    """A family that exists only in this test: Llama's decoder under another model_type, with a key of its own."""

    model_type = "cbrun_tiny_test"
    architecture = "CbrunTinyTestForCausalLM"
    config_keys = frozenset({"attention_bias", "mlp_bias", "cbrun_tiny_note"})
    defaults = {"bos_token_id": None, "eos_token_id": None, "num_key_value_heads": None}


def _tiny_test_dir(tmp_path: Path) -> Path:
    """The random Llama's files under the test family's model_type and key."""
    path = tmp_path / "tiny"
    shutil.copytree(random_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type=TinyTestFamily.model_type, cbrun_tiny_note="read by TinyTestFamily only")
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_family_is_one_class_plus_one_registry_line(tmp_path, monkeypatch, caplog):
    path = _tiny_test_dir(tmp_path)
    plan, reason = load_plan(path, "float32")
    assert plan is None and "model_type 'cbrun_tiny_test' is not one of llama" in reason

    monkeypatch.setattr(registry, "FAMILIES", registry.FAMILIES + (TinyTestFamily(),))
    plan, reason = load_plan(path, "float32")
    assert reason is None and plan.config.architecture == "CbrunTinyTestForCausalLM"

    config = EngineConfig(page_size=4, max_batch_tokens=16, num_blocks=256)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = random_prompts(6, plan.config.vocab_size, 1, 20)
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        got = run_engine(path, prompts, config, params)
    assert "model implementation: lean (CbrunTinyTestForCausalLM)" in caplog.text
    want = run_engine(random_model_dir("llama"), prompts, config, params)
    assert {i: o.output_token_ids for i, o in got.items()} == {i: o.output_token_ids for i, o in want.items()}


def _family_names() -> dict[str, str]:
    """Each registered family's identifying strings (model_type, architecture, MoE block and expert names) ->
    the family's architecture."""
    names = {}
    for family in registry.FAMILIES:
        found = [family.model_type, family.architecture]
        if isinstance(family, LlamaDecoderFamily):
            found += [family.moe_module] if family.moe_module else []
            if family.moe_block:
                found += [family.moe_block[0], *family.moe_block[1]]
        names.update({name: family.architecture for name in found if name not in ("mlp", "gate_proj", "up_proj")})
    return names


def _string_constants(path: Path) -> set[str]:
    """The string literals of a module, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }


def test_family_tables_live_only_in_the_family_files():
    names = _family_names()
    assert {"llama", "MixtralForCausalLM", "block_sparse_moe", "Qwen3MoeSparseMoeBlock"} <= set(names)
    outside = [p for p in sorted(MODEL_ROOM.rglob("*.py")) if MODEL_ROOM / "models" not in p.parents]
    assert MODEL_ROOM / "registry.py" in outside and MODEL_ROOM / "safetensors_loader.py" in outside
    found = {f"{p.relative_to(MODEL_ROOM)}: {s!r}" for p in outside for s in _string_constants(p) if s in names}
    assert not found, f"family names outside cbrun/engine/model/models/: {sorted(found)}"
