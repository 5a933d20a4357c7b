"""A model whose forward pass reads a value back to the host is never captured in a graph: "auto" runs it eager
and says why, "on" and "emulate" are refused by name; and the reason is real (captured anyway, the emulated
capture meets the host read)."""

from __future__ import annotations

import logging

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.worker import backends
from tests.model_utils import TINY_DECODER, random_llama_dir, session_tmp_dir

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


def dynamic_rope_llama_dir():
    config = LlamaConfig(**dict(TINY_DECODER, max_position_embeddings=64, rope_parameters=DYNAMIC))
    path = session_tmp_dir("cbrun-dynamic-rope-")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_the_forward_passes_that_read_back_are_named():
    assert "dynamic RoPE scaling (rope_type 'dynamic')" in backends.forward_host_read(
        LlamaConfig(rope_parameters=DYNAMIC)
    )
    assert "mixture-of-experts" in backends.forward_host_read(Qwen3MoeConfig(num_experts=8))
    assert backends.forward_host_read(LlamaConfig()) is None
    assert backends.forward_host_read(LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0})) is None


def test_auto_runs_such_a_model_eager_and_on_is_refused(caplog):
    model_config = LlamaConfig(rope_parameters=DYNAMIC)
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        assert not backends.use_cuda_graphs(EngineConfig(device="cuda"), True, model_config)
    assert "CUDA graphs off: the model's forward pass reads a value back to the host" in caplog.text
    assert backends.use_cuda_graphs(EngineConfig(device="cuda"), True, LlamaConfig())
    with pytest.raises(ValueError, match="cuda_graphs = on, but .*dynamic RoPE"):
        backends.use_cuda_graphs(EngineConfig(device="cuda", cuda_graphs="on"), True, model_config)


def test_emulated_capture_is_refused_by_name_and_would_meet_the_host_read(monkeypatch):
    model_dir = str(dynamic_rope_llama_dir())
    config = EngineConfig(page_size=4, num_blocks=64, cuda_graphs="emulate")
    with pytest.raises(ValueError, match="cuda_graphs = emulate, but .*dynamic RoPE"):
        LLMEngine.from_pretrained(model_dir, config)
    monkeypatch.setattr(backends, "forward_host_read", lambda model_config: None)  # capture it anyway
    engine = LLMEngine.from_pretrained(model_dir, config)
    with pytest.raises(RuntimeError, match="reads a tensor's value on the host"):
        list(engine.generate([(0, [1, 2, 3], SamplingParams(max_new_tokens=4))]))
    plain = LLMEngine.from_pretrained(str(random_llama_dir()), config)  # a plain model is captured and replayed
    assert len(list(plain.generate([(0, [1, 2, 3], SamplingParams(max_new_tokens=4))]))[0].output_token_ids) == 4
    assert plain.stats.num_cuda_graph_replays > 0
