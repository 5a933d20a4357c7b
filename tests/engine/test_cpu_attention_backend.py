"""attention_backend = "cpu": the engine's greedy tokens equal the PyTorch reference's; refused where it cannot run."""

from __future__ import annotations

import pytest
import torch
import transformers

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.model.layers.attention import register_with_transformers
from cbrun.kernels.cpu_attention import unavailable_reason
from tests.model_utils import random_llama_dir, random_prompts, run_engine

needs_kernel = pytest.mark.skipif(unavailable_reason() is not None, reason=f"CPU kernel: {unavailable_reason()}")
# page_size 4 and a 16-token budget: chunked prefills and decodes share steps, contexts cross many page boundaries.
ENGINE_CONFIG = dict(page_size=4, max_batch_tokens=16, num_blocks=256)


@needs_kernel
def test_cpu_kernel_tokens_equal_reference():
    model_dir = random_llama_dir()
    prompts = random_prompts(6, 128, min_len=1, max_len=30)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    cpu = run_engine(model_dir, prompts, EngineConfig(**ENGINE_CONFIG, attention_backend="cpu"), params)
    ref = run_engine(model_dir, prompts, EngineConfig(**ENGINE_CONFIG, attention_backend="torch"), params)
    assert {i: o.output_token_ids for i, o in cpu.items()} == {i: o.output_token_ids for i, o in ref.items()}
    assert all(len(o.output_token_ids) == 12 for o in cpu.values())


def _model(dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    config._attn_implementation = register_with_transformers()
    return transformers.LlamaForCausalLM(config).eval().to(dtype)


def test_cpu_kernel_refused_for_bfloat16_and_auto_falls_back():
    with pytest.raises(ValueError, match="attention_backend = cpu, but .*float32 only"):
        LLMEngine(
            _model(torch.bfloat16), EngineConfig(**ENGINE_CONFIG, dtype="bfloat16", attention_backend="cpu"), (), 64
        )
    engine = LLMEngine(_model(torch.bfloat16), EngineConfig(**ENGINE_CONFIG, dtype="bfloat16"), (), 64)
    assert not engine.model_runner.use_cpu_kernel
    engine = LLMEngine(_model(torch.float32), EngineConfig(**ENGINE_CONFIG), (), 64)
    assert engine.model_runner.use_cpu_kernel == (unavailable_reason() is None)
