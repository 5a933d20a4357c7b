"""The lean MoE block on the fused Triton kernel (``SparseMoE``'s "triton" backend), run through Triton's interpreter
on the CPU: which backend each device and weight kind gets, greedy tokens equal to transformers' ``generate`` on a
tiny Qwen3-MoE with dense, FP8 and int4-quantized experts (the quantized ones kept quantized, never dequantized per
forward), and an emulated CUDA-graph capture of the block that meets no host read and replays new inputs right."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton")
from cbrun.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cbrun.engine.model.layers import moe as moe_module  # noqa: E402
from cbrun.engine.model.layers.moe import MoEWeights, SparseMoE, choose_moe_backend  # noqa: E402
from cbrun.engine.model.layers.quantization.base import QuantizedExperts  # noqa: E402
from cbrun.engine.worker.graph_emulation import EmulatedGraph  # noqa: E402
from tests.model_utils import hf_greedy, random_model_dir, random_prompts  # noqa: E402

ENGINE_CONFIG = dict(page_size=4, max_batch_tokens=16, num_blocks=128, dtype="float32")
NEW_TOKENS = 4


def test_backend_rule():
    bf16, fp16 = torch.bfloat16, torch.float16
    assert choose_moe_backend("cuda", (9, 0), True, bf16, None, None)[0] == "triton"  # quantized: always
    assert choose_moe_backend("cuda", (9, 0), False, bf16, None, None)[0] == "grouped_mm"
    assert choose_moe_backend("cuda", (8, 0), False, bf16, None, None)[0] == "triton"  # pre-sm_90
    assert choose_moe_backend("cuda", (9, 0), False, fp16, None, None)[0] == "triton"
    backend, reason = choose_moe_backend("cuda", (9, 0), True, bf16, None, "int4 group_size 8 is not a multiple")
    assert backend == "grouped_mm" and "dequantized per forward" in reason
    assert choose_moe_backend("cpu", None, True, bf16, None, None)[0] == "grouped_mm"  # the CPU keeps its path
    assert choose_moe_backend("cpu", None, False, fp16, "no grouped GEMM", "float16 experts") == (
        "reference",
        "no grouped GEMM on cpu (the C kernel: float16 experts)",
    )


@pytest.fixture
def force_triton(monkeypatch):
    """``SparseMoE`` takes the fused Triton kernel on the CPU (the interpreter), as it would on CUDA."""
    monkeypatch.setattr(moe_module, "select_moe_backend", lambda moe, reason: ("triton", "forced by the test"))


def _engine_blocks(engine: LLMEngine) -> list[SparseMoE]:
    return [layer.moe for layer in engine.model_runner.lean_model.layers if layer.moe is not None]


@pytest.mark.parametrize("layout", [None, "fp8-block", "ct-sym"], ids=["dense", "fp8-block", "int4-ct"])
def test_greedy_tokens_equal_generate_through_the_kernel(layout, force_triton, monkeypatch, caplog):
    model_dir = random_model_dir("qwen3_moe", norm_topk_prob=True)
    reference_dir = model_dir
    quantized = layout is not None
    if layout == "fp8-block":
        from tests.engine.model.test_quantization import _quantized_copy

        model_dir, reference_dir = _quantized_copy(model_dir, layout)
    elif layout == "ct-sym":
        from tests.engine.model.test_int4_quantization import _quantized_copy as int4_copy

        model_dir, reference_dir = int4_copy(model_dir, layout)
    moe_module._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        engine = LLMEngine.from_pretrained(str(model_dir), EngineConfig(**ENGINE_CONFIG))
    assert caplog.text.count("MoE experts: triton (forced by the test)") == 1  # one line for all layers
    blocks = _engine_blocks(engine)
    assert blocks and all(b.backend == "triton" and b.kernel_weights is not None for b in blocks)
    if quantized:
        for block in blocks:
            assert isinstance(block.weights.gate_up, QuantizedExperts)
            gate = block.kernel_weights[0]
            assert gate.format == ("fp8" if layout == "fp8-block" else "int4")
            # the per-expert weights are views of the stacks: the quantized bytes are held once
            expert = block.weights.gate_up.experts[1][0]
            first = expert.qweight if layout == "fp8-block" else expert.packed
            assert first.untyped_storage().data_ptr() == gate.data.untyped_storage().data_ptr()

        def no_dequantization(*args, **kwargs):
            raise AssertionError("a forward dequantized the layer's experts")

        monkeypatch.setattr(MoEWeights, "dense", no_dequantization)
    prompts = random_prompts(3, 128, 2, 12, seed=5)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == hf_greedy(reference_dir, prompt, NEW_TOKENS), f"prompt {i}"


def _fp8_block(seed: int = 3) -> MoEWeights:
    """A random MoE block whose experts are FP8 with 16 x 32 scale blocks (kept quantized)."""
    from cbrun.engine.model.layers.quantization.fp8 import QuantizedWeight

    g = torch.Generator().manual_seed(seed)
    experts, hidden, width = 4, 64, 32

    def weight(n: int, k: int) -> QuantizedWeight:
        q = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(n // 16, k // 32, generator=g) * 0.01 + 0.001
        return QuantizedWeight(q, scale, (16, 32), torch.float32)

    return MoEWeights(
        router=torch.randn(experts, hidden, generator=g),
        gate_up=QuantizedExperts(
            [[weight(width, hidden), weight(width, hidden)] for _ in range(experts)], torch.float32
        ),
        down=QuantizedExperts([[weight(hidden, width)] for _ in range(experts)], torch.float32),
        top_k=2,
        norm_topk_prob=True,
        weights_in_model_dtype=False,
    )


def test_the_block_is_captured_without_host_reads_and_replays(force_triton):
    from cbrun.engine.model.layers.moe import sparse_moe_reference

    weights = _fp8_block()
    block = SparseMoE(weights)
    assert block.backend == "triton"
    g = torch.Generator().manual_seed(11)
    first, second = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    static_x = first.clone()
    kernel_tensors = [t for w in block.kernel_weights for t in (w.data, w.scales, w.zeros) if t is not None]
    graph = EmulatedGraph()
    with graph.capture(static=[static_x, *weights.tensors(), *kernel_tensors]):  # raises on a host read
        out = block(static_x)
    assert graph.num_ops > 0
    static_x.copy_(second)
    graph.replay()
    want = sparse_moe_reference(second, weights.dense())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, sparse_moe_reference(first, weights.dense()))  # the replay recomputed it
    with pytest.raises(RuntimeError, match="reads a tensor's value on the host"):  # the check itself can fail
        with EmulatedGraph().capture():
            float(static_x.sum())


def test_a_block_with_unwired_features_keeps_the_other_paths():
    """A block with what the wiring does not pass to the kernel (expert biases, another activation) is not sent to
    it: it would run without them."""
    from dataclasses import replace

    from cbrun.engine.model.layers.moe import _triton_blocker

    plain = _fp8_block()
    assert _triton_blocker(plain) is None
    biased = replace(plain, gate_up_bias=torch.zeros(4, 64))
    assert "gate_up_bias is not wired" in _triton_blocker(biased)
    other_activation = replace(plain, activation=lambda x: x)
    assert "activation" in _triton_blocker(other_activation)
