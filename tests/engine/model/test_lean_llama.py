"""The lean Llama-family forward pass: the same logits as transformers' modules, bit for bit, step by step (on
torch's GEMM; within float32 rounding with every projection on oneDNN's).

Each step of a real engine run (chunked prefill forced, so prefill chunks and decodes share batches) goes through
transformers' forward and then through ``LeanLlama`` on the same inputs; the logits must be ``torch.equal``. Both
write the same K/V, so the run itself proceeds as on transformers alone.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.model.layers.attention import register_with_transformers
from cbrun.engine.model.layers.linear import onednn_unavailable_reason
from cbrun.engine.model.models.llama import LeanLlama
from cbrun.engine.model.registry import unsupported_reason, weights_from_module
from tests.model_utils import TINY_DECODER, WEIGHT_SCALE, hf_greedy, random_llama_dir, random_prompts, run_engine

VOCAB = 128
NEW_TOKENS = 8
ENGINE_CONFIG = dict(page_size=4, max_batch_tokens=16, num_blocks=256)
_BASE = dict(TINY_DECODER, vocab_size=VOCAB, intermediate_size=96, max_position_embeddings=128)


def _random_model(
    config_class=transformers.LlamaConfig, model_class=transformers.LlamaForCausalLM, dtype=torch.float32, **overrides
) -> torch.nn.Module:
    """A small random model on the engine's attention; every weight, bias and norm scale perturbed."""
    torch.manual_seed(0)
    config = config_class(**dict(_BASE, **overrides))
    config._attn_implementation = register_with_transformers()
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # biases start at zero and norms at one: make them matter
            param.mul_(WEIGHT_SCALE).add_(0.05 * torch.randn_like(param))
    return model.to(dtype)


class _BothForwards:
    """Stands in for the runner's model: runs transformers, then the lean pass, and compares their logits: equal
    bit for bit on torch's GEMM, within float32 rounding on oneDNN's."""

    def __init__(self, model: torch.nn.Module, linear_backend: str = "torch") -> None:
        self.model, self.lean = model, LeanLlama(weights_from_module(model), linear_backend=linear_backend)
        self.exact = linear_backend == "torch"
        self.num_steps = self.num_mixed_steps = 0

    def __call__(self, input_ids, position_ids, logits_to_keep, cbrun_metadata, **kwargs):
        expected = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            logits_to_keep=logits_to_keep,
            cbrun_metadata=cbrun_metadata,
            **kwargs,
        )
        got = self.lean(input_ids[0], position_ids[0], cbrun_metadata, logits_to_keep)
        if self.exact:
            assert torch.equal(got, expected.logits[0]), f"step {self.num_steps}: logits differ"
        else:
            torch.testing.assert_close(
                got, expected.logits[0], rtol=1e-5, atol=1e-5, msg=lambda m: f"step {self.num_steps}: {m}"
            )
        q_lens = cbrun_metadata.cu_seqlens_q.diff()
        self.num_steps += 1
        self.num_mixed_steps += bool((q_lens == 1).any() and (q_lens > 1).any())
        return expected


def _check_every_step(model: torch.nn.Module, linear_backend: str = "torch") -> _BothForwards:
    config = EngineConfig(**ENGINE_CONFIG, model_impl="transformers")
    engine = LLMEngine(model, config, eos_token_ids=(), max_model_len=model.config.max_position_embeddings)
    both = _BothForwards(model, linear_backend)
    engine.model_runner.model = both
    prompts = random_prompts(12, VOCAB, 1, 30)
    outputs = list(engine.generate((i, p, SamplingParams(max_new_tokens=NEW_TOKENS)) for i, p in enumerate(prompts)))
    assert len(outputs) == len(prompts)
    return both


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),  # GQA, untied embeddings
        dict(num_key_value_heads=4, tie_word_embeddings=True),  # MHA, tied
        dict(num_key_value_heads=1, head_dim=32, attention_bias=True, mlp_bias=True),  # MQA, wide heads, biases
        dict(dtype=torch.bfloat16),
        dict(config_class=transformers.Qwen2Config, model_class=transformers.Qwen2ForCausalLM),  # q/k/v biases
        dict(config_class=transformers.MistralConfig, model_class=transformers.MistralForCausalLM, sliding_window=None),
        # per-head q/k RMSNorm, every projection biased, head_dim 32 != hidden / heads
        dict(
            config_class=transformers.Qwen3Config,
            model_class=transformers.Qwen3ForCausalLM,
            attention_bias=True,
            head_dim=32,
        ),
    ],
    ids=["llama-gqa-untied", "llama-mha-tied", "llama-mqa-bias", "llama-bf16", "qwen2", "mistral-no-window", "qwen3"],
)
def test_lean_logits_equal_transformers_every_step(kwargs):
    model = _random_model(**kwargs)
    assert unsupported_reason(model) is None
    both = _check_every_step(model)
    assert both.num_mixed_steps > 0, "no step mixed prefill and decode"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(config_class=transformers.Qwen2Config, model_class=transformers.Qwen2ForCausalLM),  # q/k/v biases
    ],
    ids=["llama-gqa-untied", "qwen2"],
)
def test_lean_logits_on_onednn_match_transformers_every_step(kwargs):
    if onednn_unavailable_reason(torch.zeros(1, 1)):
        pytest.skip("this torch build has no oneDNN linear op")
    both = _check_every_step(_random_model(**kwargs), linear_backend="onednn")  # every projection on oneDNN
    assert both.num_mixed_steps > 0, "no step mixed prefill and decode"


@pytest.mark.parametrize("linear_backend", ["auto", "onednn"])
def test_engine_lean_greedy_equals_generate_and_transformers_impl(linear_backend, caplog):
    if linear_backend == "onednn" and onednn_unavailable_reason(torch.zeros(1, 1)):
        pytest.skip("this torch build has no oneDNN linear op")
    model_dir = random_llama_dir(VOCAB)
    prompts = random_prompts(8, VOCAB, 1, 40)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    lean_config = EngineConfig(**ENGINE_CONFIG, model_impl="lean", linear_backend=linear_backend)
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        lean = run_engine(model_dir, prompts, lean_config, params)
    assert "model implementation: lean" in caplog.text
    modules = run_engine(model_dir, prompts, EngineConfig(**ENGINE_CONFIG, model_impl="transformers"), params)
    for i, prompt in enumerate(prompts):
        want = hf_greedy(model_dir, prompt, NEW_TOKENS)
        assert lean[i].output_token_ids == want == modules[i].output_token_ids, f"prompt {i}"


class _SubclassedLlama(transformers.LlamaForCausalLM):
    pass


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0)), "rope_type 'linear'"),
        (dict(hidden_act="gelu"), "activation"),
        (
            dict(
                config_class=transformers.MistralConfig, model_class=transformers.MistralForCausalLM, sliding_window=8
            ),
            "sliding_window = 8",
        ),
        (dict(model_class=_SubclassedLlama), "_SubclassedLlama is not one of"),
        (
            dict(
                config_class=transformers.Qwen3Config,
                model_class=transformers.Qwen3ForCausalLM,
                use_sliding_window=True,
                sliding_window=8,
                max_window_layers=1,
            ),
            "sliding_window = 8",
        ),
    ],
    ids=["rope-linear", "gelu", "mistral-window", "subclass", "qwen3-window"],
)
def test_unsupported_model_refused_with_reason(kwargs, reason, caplog):
    model = _random_model(**kwargs)
    assert reason in unsupported_reason(model)
    max_len = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"model_impl = lean, but .*{reason}"):
        LLMEngine(model, EngineConfig(**ENGINE_CONFIG, model_impl="lean"), (), max_len)
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        engine = LLMEngine(model, EngineConfig(**ENGINE_CONFIG, model_impl="auto"), (), max_len)
    assert engine.model_runner.lean_model is None
    assert "model implementation: transformers (lean path not used" in caplog.text


def test_model_impl_is_validated():
    with pytest.raises(ValueError, match="model_impl must be one of"):
        EngineConfig(model_impl="fast")
