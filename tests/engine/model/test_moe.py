"""The lean MoE block (``cbrun.engine.model.layers.moe``): the grouped path equals its reference over a grid of shapes,
reads nothing back to the host, the CPU picks the C kernel where it computes the block (and replays it in an
emulated graph), and the engine's greedy tokens on random Qwen3-MoE, Mixtral and Qwen2-MoE equal transformers'
``generate`` through the C kernel, on the transformers-free loader and on transformers' own modules. (The
step-by-step logits, bit for bit, on the grouped GEMM transformers also runs, are in ``test_safetensors_loader.py``'s
MoE cases; the kernel itself in ``tests/kernels/test_cpu_moe.py``.)"""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.moe_lean import HostReads
from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.model import registry
from cbrun.engine.model.layers.activation import ClampedSwiGLU, invariant_sigmoid
from cbrun.engine.model.layers.moe import (
    SparseMoE,
    _cpu_kernel_blocker,
    choose_moe_backend,
    sparse_moe,
    sparse_moe_reference,
)
from cbrun.engine.worker.graph_emulation import EmulatedGraph
from cbrun.kernels import cpu_moe
from tests.model_utils import hf_greedy, random_model_dir, random_moe_weights, random_prompts

ENGINE_CONFIG = dict(page_size=4, max_batch_tokens=16, num_blocks=256)
NEW_TOKENS = 8


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 37])
@pytest.mark.parametrize(
    "experts,top_k,norm,cast", [(4, 2, True, False), (8, 1, False, True), (16, 4, False, True), (8, 8, True, True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_path_equals_reference(num_tokens, experts, top_k, norm, cast, dtype):
    moe = random_moe_weights(experts, top_k, hidden=64, width=32, dtype=dtype, norm=norm, cast=cast)
    assert SparseMoE(moe).fallback_reason is None
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    got, want = sparse_moe(x, moe), sparse_moe_reference(x, moe)
    assert got.shape == want.shape == x.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert not torch.equal(got, torch.zeros_like(got))


class _HostReads(TorchDispatchMode):
    """Records the ops that read a device value back to the host or give a data-dependent shape."""

    SYNCING = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "bincount", "repeat_interleave")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(name.startswith(s) for s in self.SYNCING):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_grouped_path_reads_nothing_back():
    moe = random_moe_weights(8, 2, hidden=64, width=32, dtype=torch.float32, norm=True, cast=False)
    x = torch.randn(5, 64)
    with _HostReads() as reads:
        sparse_moe(x, moe)
    assert reads.ops == []
    with _HostReads() as reads:  # the check itself can fail: transformers' eager expert loop reads back
        torch.nonzero(x > 0)
    assert reads.ops


def test_unaligned_experts_run_the_reference_above_the_kernels_steps():
    moe = random_moe_weights(4, 2, hidden=64, width=6, dtype=torch.float32, norm=True, cast=False)  # 24-byte down rows
    block = SparseMoE(moe)
    assert "16-byte" in block.fallback_reason
    assert block.backend == "cpu_kernel"  # the C kernel takes any width
    x = torch.randn(40, 64)  # 20 rows an expert: above cpu_moe.MAX_ROWS_PER_EXPERT
    torch.testing.assert_close(block(x), sparse_moe_reference(x, moe), rtol=0, atol=0)
    torch.testing.assert_close(block(x[:7]), sparse_moe_reference(x[:7], moe), rtol=1e-5, atol=1e-5)


def test_cpu_backend_rule():
    """Dense float32 / bfloat16 SiLU experts on the CPU run the C kernel; what it does not compute (expert biases,
    another activation, float16, quantized experts) or a machine where it does not build keeps the PyTorch path,
    saying why."""
    assert choose_moe_backend("cpu", None, False, torch.float32, None, None)[0] == "cpu_kernel"
    assert choose_moe_backend("cpu", None, False, torch.float32, "unaligned", "no C compiler") == (
        "reference",
        "unaligned on cpu (the C kernel: no C compiler)",
    )
    assert choose_moe_backend("cpu", None, True, torch.bfloat16, None, None)[0] == "grouped_mm"  # quantized
    assert choose_moe_backend("mps", None, False, torch.float32, None, None)[0] == "grouped_mm"
    plain = random_moe_weights(4, 2, hidden=64, width=32, dtype=torch.bfloat16, norm=True, cast=True)
    assert _cpu_kernel_blocker(plain) is None and SparseMoE(plain).backend == "cpu_kernel"
    biased = replace(plain, gate_up_bias=torch.zeros(4, 64), down_bias=torch.zeros(4, 64))
    assert _cpu_kernel_blocker(biased) == "the experts have biases" and SparseMoE(biased).backend == "grouped_mm"
    clamped = replace(plain, activation=ClampedSwiGLU(1.702, 7.0))
    assert "is not SiLU" in _cpu_kernel_blocker(clamped) and SparseMoE(clamped).backend == "grouped_mm"
    half = random_moe_weights(4, 2, hidden=64, width=32, dtype=torch.float16, norm=True, cast=True)
    assert "float16" in _cpu_kernel_blocker(half)


def test_the_kernel_block_reads_nothing_back_and_replays_in_an_emulated_graph():
    """The C kernel is dispatched as one op (``torch.ops.cbrun.cpu_moe``): a recorder sees it and replays it over
    new inputs, and the block reads nothing back to the host."""
    moe = random_moe_weights(8, 2, hidden=64, width=32, dtype=torch.float32, norm=True, cast=False)
    block = SparseMoE(moe)
    assert block.backend == "cpu_kernel"
    g = torch.Generator().manual_seed(4)
    first, second = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    with HostReads() as reads:
        block(first)
    assert not reads.ops
    static_x = first.clone()
    graph = EmulatedGraph()
    with graph.capture(static=[static_x, *moe.tensors()]):
        out = block(static_x)
    static_x.copy_(second)
    graph.replay()
    torch.testing.assert_close(out, sparse_moe_reference(second, moe), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, sparse_moe_reference(first, moe))  # the replay recomputed it


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=(1,))),
        ("mixtral", {}),
        ("qwen2_moe", dict(mlp_only_layers=(0,))),
        ("qwen2_moe", dict(norm_topk_prob=True, decoder_sparse_step=2)),
    ],
    ids=["qwen3-moe-norm-dense-layer", "mixtral", "qwen2-moe-dense-layer", "qwen2-moe-norm-sparse-step"],
)
@pytest.mark.parametrize("loader", ["auto", "transformers"])
def test_engine_greedy_equals_generate(model_type, overrides, loader, caplog):
    model_dir = random_model_dir(model_type, **overrides)
    prompts = random_prompts(6, 128, 1, 30)
    config = EngineConfig(**ENGINE_CONFIG, loader=loader, model_impl="lean")
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        engine = LLMEngine.from_pretrained(str(model_dir), config)
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    assert "model implementation: lean" in caplog.text
    blocks = [layer.moe for layer in engine.model_runner.lean_model.layers if layer.moe is not None]
    # every step has at most 16 tokens: 8 rows an expert (4 experts, 2 a token), all through the C kernel
    assert blocks and all(block.backend == "cpu_kernel" for block in blocks)
    assert cpu_moe.runs_step(ENGINE_CONFIG["max_batch_tokens"], 2, 4)
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == hf_greedy(model_dir, prompt, NEW_TOKENS), f"prompt {i}"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_bfloat16_engine_greedy_equals_generate_through_the_kernel(model_type):
    """bfloat16 experts through the C kernel (bfloat16 routing weights for Qwen3-MoE, float32 for Mixtral) against
    transformers' ``generate`` on the same model cast to bfloat16."""
    from transformers import AutoModelForCausalLM

    from tests.model_utils import greedy_generate

    model_dir = random_model_dir(model_type, **(dict(norm_topk_prob=True) if model_type == "qwen3_moe" else {}))
    prompts = random_prompts(4, 128, 1, 30)
    engine = LLMEngine.from_pretrained(str(model_dir), EngineConfig(**ENGINE_CONFIG, dtype="bfloat16"))
    blocks = [layer.moe for layer in engine.model_runner.lean_model.layers if layer.moe is not None]
    assert blocks and all(b.backend == "cpu_kernel" and b.weights.gate_up.dtype == torch.bfloat16 for b in blocks)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == greedy_generate(model, prompt, NEW_TOKENS), f"prompt {i}"


@pytest.mark.parametrize(
    "overrides,named",
    [
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        (dict(decoder_sparse_step=0), "decoder_sparse_step"),
        (dict(moe_shared_gate_bias=True), "moe_shared_gate_bias"),
    ],
    ids=["sliding-window", "sliding-layer", "sparse-step-0", "unknown-key"],
)
def test_qwen2_moe_refuses_by_name(overrides, named):
    """What the Qwen2-MoE family does not run is refused at load, naming the setting."""
    raw = json.loads((random_model_dir("qwen2_moe") / "config.json").read_text())
    assert registry.parse_config(raw)[1] is None
    config, reason = registry.parse_config({**raw, **overrides})
    assert config is None and named in reason


def test_invariant_sigmoid_gives_each_element_the_same_bits_at_any_length():
    # torch.sigmoid's scalar tail on the CPU gives the last elements of a length other bits (a shared expert's
    # gate under batch_invariant = on)
    x = torch.randn(300, 1, generator=torch.Generator().manual_seed(0))
    whole = invariant_sigmoid(x)
    torch.testing.assert_close(whole, torch.sigmoid(x))
    for start, length in [(0, 1), (3, 7), (5, 33), (100, 65), (17, 200)]:
        assert torch.equal(invariant_sigmoid(x[start : start + length].clone()), whole[start : start + length])
