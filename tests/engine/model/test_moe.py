"""The lean MoE block (``cbrun.engine.model.layers.moe``): the grouped path equals its reference over a grid of shapes,
reads nothing back to the host, and the engine's greedy tokens on random Qwen3-MoE and Mixtral equal transformers'
``generate``, on the transformers-free loader and on transformers' own modules. (The step-by-step logits, bit for
bit, are in ``test_safetensors_loader.py``'s MoE cases.)"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cbrun.engine import EngineConfig, SamplingParams
from cbrun.engine.model import registry
from cbrun.engine.model.layers.activation import invariant_sigmoid
from cbrun.engine.model.layers.moe import MoEWeights, SparseMoE, sparse_moe, sparse_moe_reference
from tests.model_utils import hf_greedy, random_model_dir, random_prompts, run_engine

ENGINE_CONFIG = dict(page_size=4, max_batch_tokens=16, num_blocks=256)
NEW_TOKENS = 8


def _random_moe(experts: int, top_k: int, hidden: int, width: int, dtype, norm: bool, cast: bool) -> MoEWeights:
    g = torch.Generator().manual_seed(experts * 100 + top_k)
    return MoEWeights(
        router=torch.randn(experts, hidden, generator=g).to(dtype),
        gate_up=(torch.randn(experts, 2 * width, hidden, generator=g) / hidden**0.5).to(dtype),
        down=(torch.randn(experts, hidden, width, generator=g) / width**0.5).to(dtype),
        top_k=top_k,
        norm_topk_prob=norm,
        weights_in_model_dtype=cast,
    )


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 37])
@pytest.mark.parametrize(
    "experts,top_k,norm,cast", [(4, 2, True, False), (8, 1, False, True), (16, 4, False, True), (8, 8, True, True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_path_equals_reference(num_tokens, experts, top_k, norm, cast, dtype):
    moe = _random_moe(experts, top_k, hidden=64, width=32, dtype=dtype, norm=norm, cast=cast)
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
    moe = _random_moe(8, 2, hidden=64, width=32, dtype=torch.float32, norm=True, cast=False)
    x = torch.randn(5, 64)
    with _HostReads() as reads:
        sparse_moe(x, moe)
    assert reads.ops == []
    with _HostReads() as reads:  # the check itself can fail: transformers' eager expert loop reads back
        torch.nonzero(x > 0)
    assert reads.ops


def test_unaligned_experts_run_the_reference():
    moe = _random_moe(4, 2, hidden=64, width=6, dtype=torch.float32, norm=True, cast=False)  # 24-byte down rows
    block = SparseMoE(moe)
    assert "16-byte" in block.fallback_reason
    x = torch.randn(7, 64)
    torch.testing.assert_close(block(x), sparse_moe_reference(x, moe), rtol=0, atol=0)


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
        outputs = run_engine(model_dir, prompts, config, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert "model implementation: lean" in caplog.text
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == hf_greedy(model_dir, prompt, NEW_TOKENS), f"prompt {i}"


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
