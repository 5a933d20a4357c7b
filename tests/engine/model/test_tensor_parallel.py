"""Tensor parallelism over real gloo processes (``cbrun.engine.worker.tp_group``, ``cbrun.engine.model.layers.parallel``):
two ranks give exactly one rank's greedy tokens on random Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE and Mixtral
checkpoints (GQA, replicated KV heads, biases, tied and untied embeddings, a vocabulary that does not split evenly,
MLPs of three widths in one model, each split by its own), each rank reads only its slices of the weights, and what
a replica cannot run is refused by name before any rank starts."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.model import loader, registry
from cbrun.engine.model.layers import parallel
from cbrun.engine.model.layers.parallel import ShardLayout, read_shard
from cbrun.engine.model.safetensors_loader import load_plan
from tests.model_utils import hf_greedy, random_model_dir, random_prompts

ENGINE = dict(page_size=4, max_batch_tokens=32, max_requests_per_batch=8, num_blocks=128, dtype="float32")
CASES = {
    # 4 query heads, 2 KV heads: one KV head per rank; biases on every projection (row-parallel biases once)
    "llama-gqa-bias": ("llama", dict(attention_bias=True, mlp_bias=True, vocab_size=131)),
    # 1 KV head over 2 ranks: replicated; tied embeddings: the LM head is the vocab-parallel embedding
    "llama-mqa-tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2": ("qwen2", {}),
    # per-head q/k RMSNorm (whole on every rank), head_dim 32 != hidden / heads
    "qwen3": ("qwen3", dict(head_dim=32)),
}


def _greedy(path, tp: int, prompts, max_new_tokens: int = 12, **engine) -> dict:
    config = EngineConfig(**{**ENGINE, **engine}, tensor_parallel_size=tp)
    llm = LLMEngine.from_pretrained(str(path), config)
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        return {o.request_id: o.output_token_ids for o in llm.generate((i, p, params) for i, p in enumerate(prompts))}
    finally:
        llm.close()


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_give_the_greedy_tokens_of_one(name):
    model_type, overrides = CASES[name]
    path = random_model_dir(model_type, **overrides)
    # more prompts than requests per batch, longer than a step's token budget: chunked prefill and queueing
    prompts = random_prompts(12, overrides.get("vocab_size", 128), max_len=40)
    one = _greedy(path, 1, prompts)
    two = _greedy(path, 2, prompts)
    assert sorted(two) == list(range(len(prompts)))
    assert two == one


def test_the_cpu_attention_kernel_and_onednn_give_the_same_tokens_too():
    path = random_model_dir("llama", intermediate_size=4096)  # (4096, 64) gate/up/down weights: oneDNN's size
    prompts = random_prompts(4, 128, max_len=20, seed=3)
    settings = dict(attention_backend="cpu", linear_backend="auto")
    assert _greedy(path, 2, prompts, **settings) == _greedy(path, 1, prompts, **settings)


#: Qwen2-MoE whose MLPs have three widths: layer 0 dense (intermediate_size 64), layer 1 sparse with a shared
#: expert 96 wide (shared_expert_intermediate_size, wider as Qwen2-57B-A14B's) beside experts 32 wide
#: (moe_intermediate_size, held whole).
QWEN2_MOE_WIDTHS = dict(mlp_only_layers=(0,), intermediate_size=64, shared_expert_intermediate_size=96)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "model_type, overrides",
    [("llama", dict(num_key_value_heads=2, attention_bias=True)), ("qwen2_moe", QWEN2_MOE_WIDTHS)],
)
def test_each_rank_reads_its_slices_and_they_make_up_the_whole(world_size, model_type, overrides):
    path = random_model_dir(model_type, vocab_size=131, **overrides)
    plan, _ = load_plan(path, "float32")
    config = plan.config
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            whole = handle.get_tensor(name)
            style = registry.family_of(config).shard_style(name)
            parts = [read_shard(handle, name, ShardLayout.of(config, r, world_size), style) for r in range(world_size)]
            split = ShardLayout.of(config, 0, world_size).split(style, tuple(whole.shape))
            if split is None:  # norms, row-parallel biases: every rank holds them whole
                assert all(torch.equal(p, whole) for p in parts), name
                continue
            dim = split[0]
            if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")) and world_size > 2:
                # 2 KV heads over 4 ranks: each is replicated on 2 ranks, in order
                parts = parts[:: world_size // config.num_key_value_heads]
            joined = torch.cat(parts, dim=dim)
            assert all(p.shape[dim] * len(parts) == joined.shape[dim] for p in parts), name  # equal parts
            if "embed_tokens" in name or "lm_head" in name:  # padded to ranks x ceil(131 / ranks) rows
                assert joined.shape[0] == world_size * -(-131 // world_size)
                assert torch.count_nonzero(joined[131:]) == 0
                joined = joined[:131]
            assert torch.equal(joined, whole), name


def test_what_a_replica_cannot_run_is_refused_by_name():
    for setting, value in [
        ("speculative", "ngram"),
        ("model_impl", "transformers"),
        ("cuda_graphs", "emulate"),
        ("batch_invariant", "on"),
    ]:
        with pytest.raises(ValueError, match=f"tensor_parallel_size = 2 does not run with {setting}"):
            EngineConfig(tensor_parallel_size=2, **{setting: value})
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)
    # 4 heads do not split over 3 ranks
    path = random_model_dir("llama")
    with pytest.raises(ValueError, match="tensor_parallel_size = 3 cannot split this model: num_attention_heads = 4"):
        loader.tensor_parallel_plan(str(path), EngineConfig(tensor_parallel_size=3, dtype="float32"))
    # an MLP whose own width does not split, named by its first tensor: a shared expert's, a dense layer's
    for overrides, named in [
        (dict(shared_expert_intermediate_size=49), "model.layers.0.mlp.shared_expert.gate_proj.weight's 49 output"),
        (dict(mlp_only_layers=(1,), intermediate_size=97), "model.layers.1.mlp.gate_proj.weight's 97 output"),
    ]:
        odd = random_model_dir("qwen2_moe", **overrides)
        with pytest.raises(ValueError, match="tensor_parallel_size = 2 cannot split this model") as info:
            loader.tensor_parallel_plan(str(odd), EngineConfig(tensor_parallel_size=2, dtype="float32"))
        assert f"{named} rows (its MLP's width) do not split over tensor_parallel_size = 2 ranks" in str(info.value)
    # a checkpoint the safetensors loader does not read loads through transformers, which is not split
    windowed = random_model_dir("mistral", sliding_window=16)
    with pytest.raises(ValueError, match="tensor_parallel_size = 2 runs only the lean path loaded from safetensors"):
        loader.tensor_parallel_plan(str(windowed), EngineConfig(tensor_parallel_size=2, dtype="float32"))


def test_a_rank_that_stops_answering_fails_the_step_within_the_timeout(monkeypatch):
    import os
    import signal
    import time

    from cbrun.engine.worker import tp_group

    monkeypatch.setattr(tp_group, "STEP_TIMEOUT_S", 2.0)
    path = random_model_dir("llama")
    llm = LLMEngine.from_pretrained(str(path), EngineConfig(**ENGINE, tensor_parallel_size=2))
    (rank,) = llm.tp_group.processes
    try:
        llm.add_request(0, [1, 2, 3], SamplingParams(max_new_tokens=4))
        os.kill(rank.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(
            tp_group.TensorParallelError, match=f"rank 1 \\(pid {rank.pid}\\) is alive but did not answer"
        ):
            while llm.has_unfinished_requests():
                llm.step()
        assert time.monotonic() - start < 30
    finally:
        os.kill(rank.pid, signal.SIGKILL)
        llm.close()
    assert rank.exitcode == -signal.SIGKILL


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("qwen3_moe", {}),
        ("mixtral", {}),
        ("qwen3_moe", dict(mlp_only_layers=(0,))),  # a dense layer among them
    ],
)
def test_moe_experts_split_over_two_ranks_give_the_greedy_tokens_of_one(model_type, overrides):
    path = random_model_dir(model_type, **overrides)
    prompts = random_prompts(8, 128, max_len=30, seed=5)
    assert _greedy(path, 2, prompts) == _greedy(path, 1, prompts)


def test_qwen2_moe_splits_each_mlp_by_its_own_width_and_equals_transformers():
    """The dense layer's 64 features split 32 per rank and the shared expert's 96 split 48 (Qwen2-57B-A14B's
    shared_expert_intermediate_size 20480 beside intermediate_size 18944, in small); the experts, 32 wide, whole."""
    path = random_model_dir("qwen2_moe", **QWEN2_MOE_WIDTHS)
    prompts = random_prompts(8, 128, max_len=30, seed=5)
    two = _greedy(path, 2, prompts)
    assert two == _greedy(path, 1, prompts)
    assert two == {i: hf_greedy(path, prompt, 12) for i, prompt in enumerate(prompts)}


def test_mlp_widths_that_are_never_split_are_not_asked_to_split():
    """Experts are held whole, so their width (Mixtral's intermediate_size, Qwen3-MoE's moe_intermediate_size) need
    not be a multiple of the ranks, nor need intermediate_size where no layer is dense."""
    config = EngineConfig(tensor_parallel_size=2, dtype="float32")
    for model_type, overrides in [
        ("mixtral", dict(intermediate_size=49)),
        ("qwen3_moe", dict(intermediate_size=97, moe_intermediate_size=33)),
        ("qwen2_moe", dict(intermediate_size=97, moe_intermediate_size=33, shared_expert_intermediate_size=64)),
    ]:
        plan = loader.tensor_parallel_plan(str(random_model_dir(model_type, **overrides)), config)
        assert plan.config.model_type == model_type


#: Qwen2-57B-A14B's config.json (one decoder layer: the check is the same for each): the shared expert 20480 wide,
#: no dense layer (intermediate_size 18944 unused), 64 experts 2560 wide, 28 query heads and 4 KV heads of 128.
QWEN2_57B_A14B = dict(
    model_type="qwen2_moe",
    vocab_size=151936,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=1,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=2560,
    shared_expert_intermediate_size=20480,
)


def test_qwen2_57b_a14b_splits_over_two_and_four_ranks():
    config, reason = registry.parse_config(QWEN2_57B_A14B)
    assert config is not None, reason
    family = registry.family_of(config)
    shapes = family.checkpoint_shapes(config)
    for size in (2, 4):
        assert family.unsupported_parallel_reason(config) is None
        assert parallel.unsupported_reason(config, shapes, family.shard_style, size) is None
        layout = ShardLayout.of(config, 1, size)
        name = "model.layers.0.mlp.shared_expert.down_proj.weight"
        assert layout.local_shape(shapes[name], family.shard_style(name)) == (3584, 20480 // size)
    reason = parallel.unsupported_reason(config, shapes, family.shard_style, 8)
    assert reason == "num_attention_heads = 28 is not a multiple of tensor_parallel_size = 8"


def test_each_rank_reads_only_its_experts():
    path = random_model_dir("qwen3_moe")
    plan, _ = load_plan(path, "float32")
    layouts = [ShardLayout.of(plan.config, r, 2) for r in range(2)]
    assert [list(layout.local_experts) for layout in layouts] == [[0, 1], [2, 3]]
    name = "model.layers.0.mlp.experts.{}.down_proj.weight"
    assert [[layout.holds(name.format(e)) for e in range(4)] for layout in layouts] == [
        [True, True, False, False],
        [False, False, True, True],
    ]
    assert all(layout.holds("model.layers.0.mlp.gate.weight") for layout in layouts)  # the router, on every rank


@pytest.mark.parametrize("grouped", [True, False])
def test_the_ranks_local_experts_sum_to_the_whole_block(grouped):
    from dataclasses import replace

    from cbrun.engine.model.layers.moe import MoEWeights, sparse_moe
    from cbrun.engine.model.layers.parallel import local_experts

    g = torch.Generator().manual_seed(0)
    num_experts, hidden, width = 8, 32, 16
    whole = MoEWeights(
        router=torch.randn(num_experts, hidden, generator=g),
        gate_up=torch.randn(num_experts, 2 * width, hidden, generator=g),
        down=torch.randn(num_experts, hidden, width, generator=g),
        top_k=3,
        norm_topk_prob=True,
        weights_in_model_dtype=False,
    )
    x = torch.randn(11, hidden, generator=g)
    per_rank = num_experts // 4
    parts = [
        local_experts(
            x,
            replace(
                whole,
                gate_up=whole.gate_up[r * per_rank : (r + 1) * per_rank],
                down=whole.down[r * per_rank : (r + 1) * per_rank],
            ),
            r * per_rank,
            grouped,
        )
        for r in range(4)
    ]
    torch.testing.assert_close(sum(parts), sparse_moe(x, whole), rtol=1e-5, atol=1e-4)
