"""The transformers-free load path (``cbrun.engine.model.safetensors_loader``, ``cbrun.engine.model.config``): config fields equal
transformers' ``AutoConfig``, tensors equal the transformers model's, and the lean pass over them gives logits
``torch.equal`` to transformers' forward and to the lean pass over the transformers-loaded model, step by step; the
engine takes it by default and falls back to transformers, saying why, for what it does not read."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors import SafetensorError
from transformers import AutoConfig

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.model import hugepages
from cbrun.engine.model.config import SIZE_KEYS, read_config_json
from cbrun.engine.model.layers import moe as moe_module
from cbrun.engine.model.models.llama import LeanLlama
from cbrun.engine.model.registry import parse_config, weights_from_module
from cbrun.engine.model.safetensors_loader import LeanModel, load, load_plan
from tests.model_utils import random_model_dir, random_prompts

ENGINE_CONFIG = dict(page_size=4, max_batch_tokens=16, num_blocks=256)
CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-mqa-bias-wide": ("llama", dict(num_key_value_heads=1, head_dim=32, attention_bias=True, mlp_bias=True)),
    "llama-theta": ("llama", dict(rope_theta=500000.0)),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral-no-window": ("mistral", {}),
    "qwen3-bias": ("qwen3", dict(attention_bias=True)),
    "qwen3-moe-dense-layer": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=(1,))),
    "mixtral": ("mixtral", {}),
    "qwen2-moe-shared-expert": ("qwen2_moe", dict(norm_topk_prob=True, mlp_only_layers=(0,))),
}


def _case_dir(name: str):
    model_type, overrides = CASES[name]
    return random_model_dir(model_type, **overrides)


def _edited_copy(src, dst, **changes):
    """A copy of the model directory with config.json keys changed (None removes a key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _assert_config_equals_auto_config(path):
    config, reason = parse_config(read_config_json(path))
    assert reason is None
    auto = AutoConfig.from_pretrained(path)
    # Qwen2's and Mixtral's configs leave head_dim to their modules: hidden_size // num_attention_heads
    head_dim = getattr(auto, "head_dim", None) or auto.hidden_size // auto.num_attention_heads
    for name in (*SIZE_KEYS, "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(config, name) == (head_dim if name == "head_dim" else getattr(auto, name)), name
    # no window: None (Qwen2-MoE's config states 0 where use_sliding_window is false)
    assert config.sliding_window is None and not getattr(auto, "sliding_window", None)
    assert config.head_dim == (getattr(auto, "head_dim", None) or auto.hidden_size // auto.num_attention_heads)
    assert config.rope_theta == auto.rope_parameters["rope_theta"]
    assert auto.rope_parameters["rope_type"] == "default"
    for name in ("attention_bias", "mlp_bias"):
        assert getattr(config, name) == getattr(auto, name, False), name
    assert config.architecture == type(auto).__name__.replace("Config", "ForCausalLM")


@pytest.mark.parametrize("name", list(CASES))
def test_config_fields_equal_auto_config(name):
    _assert_config_equals_auto_config(_case_dir(name))


def test_config_defaults_and_legacy_keys_equal_auto_config(stories260k_dir, tiny_model_dir, tmp_path):
    _assert_config_equals_auto_config(stories260k_dir)
    _assert_config_equals_auto_config(tiny_model_dir)
    llama, qwen2, mistral = _case_dir("llama-gqa-untied"), _case_dir("qwen2"), _case_dir("mistral-no-window")
    optional = dict(
        num_key_value_heads=None,
        head_dim=None,
        tie_word_embeddings=None,
        bos_token_id=None,
        eos_token_id=None,
        rope_parameters=None,
        attention_bias=None,
        mlp_bias=None,
    )
    _assert_config_equals_auto_config(_edited_copy(llama, tmp_path / "llama-defaults", **optional))
    _assert_config_equals_auto_config(
        _edited_copy(
            qwen2,
            tmp_path / "qwen2-defaults",
            **{
                k: None
                for k in (
                    "tie_word_embeddings",
                    "bos_token_id",
                    "eos_token_id",
                    "rope_parameters",
                    "layer_types",
                    "use_sliding_window",
                    "max_window_layers",
                )
            },
        )
    )
    _assert_config_equals_auto_config(
        _edited_copy(mistral, tmp_path / "mistral-defaults", bos_token_id=None, eos_token_id=None, rope_parameters=None)
    )
    # Qwen3's head_dim defaults to 128, not hidden_size // num_attention_heads
    qwen3 = _edited_copy(_case_dir("qwen3-bias"), tmp_path / "qwen3-defaults", head_dim=None, attention_bias=None)
    _assert_config_equals_auto_config(qwen3)
    assert parse_config(read_config_json(qwen3))[0].head_dim == 128
    # Qwen2's and Mistral's default KV heads (32, 8) do not divide these 4 heads: refused, not guessed
    for path in (
        _edited_copy(qwen2, tmp_path / "qwen2-kv", num_key_value_heads=None),
        _edited_copy(mistral, tmp_path / "mistral-kv", num_key_value_heads=None),
    ):
        assert "multiple of num_key_value_heads" in parse_config(read_config_json(path))[1]
    legacy = _edited_copy(
        llama,
        tmp_path / "legacy",
        rope_parameters=None,
        rope_theta=1_000_000,
        rope_scaling=None,
        dtype=None,
        torch_dtype="float32",
    )
    _assert_config_equals_auto_config(legacy)
    config, _ = parse_config(read_config_json(legacy))
    assert config.dtype == "float32"


@pytest.fixture(autouse=True)
def grouped_experts(monkeypatch):
    """The lean MoE block on ``torch._grouped_mm``, the GEMM transformers' experts run, so the logits can be equal
    bit for bit. (On the CPU the lean block's default at decode is the C kernel, whose dot products add up in their
    own order: its greedy tokens equal transformers' in ``test_moe.py``.)"""
    monkeypatch.setattr(moe_module, "_cpu_kernel_blocker", lambda moe: "pinned to torch._grouped_mm by the test")


class _Compare:
    """Stands in for the runner's model: runs transformers' forward, then the lean pass over the fast-loaded
    tensors and over the transformers model's own; all three logits must be equal bit for bit."""

    def __init__(self, model: torch.nn.Module, fast: LeanLlama, lean: LeanLlama) -> None:
        self.model, self.fast, self.lean = model, fast, lean
        self.num_steps = 0

    def __call__(self, input_ids, position_ids, logits_to_keep, cbrun_metadata, **kwargs):
        expected = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            logits_to_keep=logits_to_keep,
            cbrun_metadata=cbrun_metadata,
            **kwargs,
        )
        got = self.fast(input_ids[0], position_ids[0], cbrun_metadata, logits_to_keep)
        assert torch.equal(got, expected.logits[0]), f"step {self.num_steps}: fast-loaded logits differ"
        assert torch.equal(got, self.lean(input_ids[0], position_ids[0], cbrun_metadata, logits_to_keep))
        self.num_steps += 1
        return expected


def _check_every_step(path, dtype: str = "float32") -> int:
    """Run random prompts through an engine on transformers' modules, comparing every step; returns the steps."""
    config = EngineConfig(**ENGINE_CONFIG, model_impl="transformers", dtype=dtype)
    engine = LLMEngine.from_pretrained(str(path), config)
    model = engine.model_runner.model
    plan, reason = load_plan(path, dtype)
    assert reason is None
    fast = load(plan, "cpu")
    # placed as ``load_model`` placed the engine's model: a GEMM's rounding may depend on its operands' alignment
    hugepages.place_on_huge_pages(fast.parameters())
    want = weights_from_module(model)
    for got_tensor, want_tensor in zip(fast.weights.tensors(), want.tensors(), strict=True):
        assert torch.equal(got_tensor, want_tensor) and got_tensor.dtype == want_tensor.dtype
    assert torch.equal(fast.weights.inv_freq, want.inv_freq)
    compare = _Compare(
        model,
        LeanLlama(fast.weights, engine.max_model_len, "torch"),
        LeanLlama(weights_from_module(model), engine.max_model_len, "torch"),
    )
    engine.model_runner.model = compare
    prompts = random_prompts(10, fast.config.vocab_size, 1, 30)
    outputs = list(
        engine.generate((i, p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for i, p in enumerate(prompts))
    )
    assert len(outputs) == len(prompts)
    return compare.num_steps


@pytest.mark.parametrize("name", list(CASES))
def test_fast_loaded_logits_equal_transformers_every_step(name):
    assert _check_every_step(_case_dir(name)) > 10


def test_fast_loaded_logits_equal_transformers_stories260k_and_bfloat16(stories260k_dir):
    assert _check_every_step(stories260k_dir) > 10
    assert _check_every_step(_case_dir("qwen2"), dtype="bfloat16") > 10  # saved float32, both cast on load


@pytest.mark.parametrize("name", ["qwen3-moe-dense-layer", "mixtral", "qwen2-moe-shared-expert"])
def test_fast_loaded_moe_logits_equal_transformers_in_bfloat16(name):
    assert _check_every_step(_case_dir(name), dtype="bfloat16") > 10  # the routing weights' dtype differs


def test_sharded_checkpoint_loads_the_same_tensors(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_case_dir("llama-gqa-untied"))
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    plan, reason = load_plan(tmp_path, "float32")
    assert reason is None and len(set(plan.files.values())) > 1
    single, _ = load_plan(_case_dir("llama-gqa-untied"), "float32")
    for a, b in zip(load(plan, "cpu").weights.tensors(), load(single, "cpu").weights.tensors(), strict=True):
        assert torch.equal(a, b)


def test_engine_loads_without_transformers_by_default_and_equals_the_transformers_loader(stories260k_dir, caplog):
    prompts = random_prompts(8, 512, 1, 40)
    params = SamplingParams(max_new_tokens=24)
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        fast = LLMEngine.from_pretrained(str(stories260k_dir), EngineConfig(**ENGINE_CONFIG))
    assert isinstance(fast.model, LeanModel) and fast.model_runner.lean_model is not None
    assert "model loader: safetensors, without transformers" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        slow = LLMEngine.from_pretrained(str(stories260k_dir), EngineConfig(**ENGINE_CONFIG, loader="transformers"))
    assert "model loader: transformers (engine.loader = transformers)" in caplog.text
    assert isinstance(slow.model, torch.nn.Module)
    assert sum(p.numel() for p in fast.model.parameters()) == sum(p.numel() for p in slow.model.parameters())
    assert (fast.max_model_len, fast.eos_token_ids, fast.num_blocks) == (
        slow.max_model_len,
        slow.eos_token_ids,
        slow.num_blocks,
    )
    got = {o.request_id: o.output_token_ids for o in fast.generate((i, p, params) for i, p in enumerate(prompts))}
    want = {o.request_id: o.output_token_ids for o in slow.generate((i, p, params) for i, p in enumerate(prompts))}
    assert got == want


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(quantization_config={"quant_method": "bitsandbytes"}), "quant_method 'bitsandbytes'"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "RoPE parameters"),
        (dict(rope_scaling={"type": "dynamic"}), "rope_type 'dynamic'"),
        (dict(hidden_act="gelu"), "activation 'gelu'"),
        (dict(tie_word_embeddings=True), "unexpected ['lm_head.weight']"),
        (dict(model_type="gemma"), "model_type 'gemma'"),
        (dict(hidden_size=None), "does not state hidden_size"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    ],
    ids=[
        "quantized",
        "rope-linear",
        "rope-dynamic-legacy",
        "gelu",
        "tied-with-lm-head",
        "gemma",
        "no-hidden",
        "bad-heads",
    ],
)
def test_what_it_does_not_read_is_left_to_transformers(change, reason, tmp_path):
    path = _edited_copy(_case_dir("llama-gqa-untied"), tmp_path / "m", **change)
    plan, got = load_plan(path, "float32")
    assert plan is None and reason in got


def test_window_weights_format_and_dtype_refusals(tmp_path, caplog):
    mistral = _edited_copy(_case_dir("mistral-no-window"), tmp_path / "mistral", sliding_window=8)
    assert "sliding_window = 8" in load_plan(mistral, "float32")[1]
    default_window = _edited_copy(_case_dir("mistral-no-window"), tmp_path / "mistral-default", sliding_window=None)
    assert "sliding_window = 4096" in load_plan(default_window, "float32")[1]  # MistralConfig's default
    qwen = _edited_copy(_case_dir("qwen2"), tmp_path / "qwen", use_sliding_window=True, sliding_window=8)
    assert "use_sliding_window" in load_plan(qwen, "float32")[1]
    no_dtype = _edited_copy(_case_dir("llama-gqa-untied"), tmp_path / "no-dtype", dtype=None)
    assert "dtype = auto, and config.json states no dtype" in load_plan(no_dtype, "auto")[1]
    assert load_plan(no_dtype, "float32")[1] is None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_case_dir("llama-gqa-untied"))
    bin_dir = _edited_copy(_case_dir("llama-gqa-untied"), tmp_path / "bin")
    (bin_dir / "model.safetensors").unlink()
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    assert "no model.safetensors" in load_plan(tmp_path / "bin", "float32")[1]
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        engine = LLMEngine.from_pretrained(str(tmp_path / "bin"), EngineConfig(**ENGINE_CONFIG))
    assert "model loader: transformers (no model.safetensors" in caplog.text
    assert engine.model_runner.lean_model is not None  # transformers-loaded, lean forward as before


@pytest.mark.parametrize(
    "settings,reason",
    [
        (dict(model_impl="transformers"), "model_impl = transformers"),
        (dict(loader="transformers"), "engine.loader = transformers"),
    ],
    ids=["model-impl", "loader"],
)
def test_settings_that_need_transformers_modules_load_with_transformers(settings, reason, caplog):
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        engine = LLMEngine.from_pretrained(
            str(_case_dir("llama-gqa-untied")), EngineConfig(**ENGINE_CONFIG, **settings)
        )
    assert isinstance(engine.model, torch.nn.Module)
    assert f"model loader: transformers ({reason}" in caplog.text


def test_a_lean_model_refuses_transformers_modules():
    plan, _ = load_plan(_case_dir("llama-gqa-untied"), "float32")
    model = load(plan, "cpu")
    with pytest.raises(ValueError, match="model_impl = transformers needs transformers' modules"):
        LLMEngine(model, EngineConfig(**ENGINE_CONFIG, model_impl="transformers"), (), 128)


def test_bad_shapes_and_corrupt_files_are_errors(tmp_path):
    wrong = _edited_copy(_case_dir("llama-gqa-untied"), tmp_path / "wrong", intermediate_size=100)
    plan, reason = load_plan(wrong, "float32")
    assert reason is None
    message = r"down_proj\.weight in model\.safetensors has shape \[64, 96\], but config\.json implies \[64, 100\]"
    with pytest.raises(RuntimeError, match=message):
        load(plan, "cpu")
    truncated = _edited_copy(_case_dir("llama-gqa-untied"), tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SafetensorError):
        load_plan(truncated, "float32")
