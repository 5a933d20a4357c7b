"""Quantized checkpoints under tensor parallelism (``cbrun.engine.model.layers.parallel.read_quantized_shard``,
``cbrun.engine.model.layers.quantization.shards``): random Llama and Qwen3-MoE checkpoints quantized into the real
layouts (FP8 128x128 blocks, compressed-tensors float8 per channel, int4 group 128 as compressed-tensors, GPTQ and
AWQ write it; ``test_quantization`` / ``test_int4_quantization`` write them), and Qwen2-MoE ones whose dense MLP and
shared expert differ in width, give on two real gloo ranks exactly one rank's greedy tokens; each rank reads about
half the quantized bytes, and its slices, dequantized, are the whole weight's; a split that does not start on a
block, group or packed word is refused by name before any rank starts."""

from __future__ import annotations

import pytest
import torch

from cbrun.engine import EngineConfig, LLMEngine
from cbrun.engine.model import loader, registry, safetensors_loader
from cbrun.engine.model.layers import parallel
from cbrun.engine.model.layers.parallel import ShardLayout, TensorParallelWeights
from cbrun.engine.model.layers.quantization.base import QuantizedExperts
from cbrun.engine.model.layers.quantization.fp8 import QuantizedWeight
from cbrun.engine.model.layers.quantization.int4 import Int4Weight
from tests.engine.model import test_int4_quantization as int4
from tests.engine.model import test_quantization as fp8
from tests.engine.model.test_tensor_parallel import _greedy
from tests.model_utils import hf_greedy, random_model_dir, random_prompts

#: Every split on 128 boundaries: head_dim 128 (2 heads, 2 KV heads: 128 q/k/v rows per rank, o_proj's 256 inputs
#: 128 per rank), intermediate 512 (256 gate/up rows and down_proj inputs per rank).
LLAMA = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2)
#: Qwen3-30B-A3B-FP8's layout in small: quantized attention (head_dim 128) and experts, split by expert.
QWEN3_MOE = dict(
    hidden_size=128,
    moe_intermediate_size=64,
    norm_topk_prob=True,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=128,
)
#: and Qwen2-MoE's MLPs of three widths, each split by its own on 128 boundaries: a dense layer 0 (intermediate_size
#: 256: 128 per rank) and layer 1's shared expert (512: 256 per rank), beside experts 64 wide held whole.
QWEN2_MOE = QWEN3_MOE | dict(mlp_only_layers=(0,), intermediate_size=256, shared_expert_intermediate_size=512)
FLOAT8 = ("fp8-block", "ct-channel")
INT4 = ("ct-sym", "ct-asym", "gptq", "awq")


def _quantized(model_type: str, layout: str, **model):
    """(quantized dir, dequantized dir) of a random ``model_type`` checkpoint in ``layout``."""
    shape = {"llama": LLAMA, "qwen3_moe": QWEN3_MOE, "qwen2_moe": QWEN2_MOE}[model_type] | model
    writer = fp8._quantized_copy if layout in FLOAT8 else int4._quantized_copy
    return writer(random_model_dir(model_type, **shape), layout)


@pytest.mark.parametrize(
    "model_type, layout",
    # the forward pass differs by float8 / int4 and dense / MoE; every layout's slices are checked below
    [
        ("llama", "fp8-block"),
        ("llama", "gptq"),
        ("qwen3_moe", "fp8-block"),
        ("qwen3_moe", "ct-sym"),
        ("qwen2_moe", "fp8-block"),
        ("qwen2_moe", "gptq"),
    ],
)
def test_two_ranks_give_the_greedy_tokens_of_one_on_quantized_weights(model_type, layout):
    quantized, dequantized = _quantized(model_type, layout)
    prompts = random_prompts(8, 128, max_len=30, seed=7)
    one = _greedy(quantized, 1, prompts)
    two = _greedy(quantized, 2, prompts)
    assert sorted(two) == list(range(len(prompts)))
    assert two == one
    if model_type == "qwen2_moe":  # and transformers' on the same weights dequantized
        assert two == {i: hf_greedy(dequantized, prompt, 12) for i, prompt in enumerate(prompts)}


class _CountingHandle:
    """A ``safe_open`` handle that counts the bytes of every tensor or slice it hands out, by tensor name."""

    def __init__(self, handle, counts: dict[str, int]) -> None:
        self.handle, self.counts = handle, counts

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def _count(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.counts[name] = self.counts.get(name, 0) + tensor.numel() * tensor.element_size()
        return tensor

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._count(name, self.handle.get_tensor(name))

    def get_slice(self, name: str):
        handle = self

        class Slice:
            def __init__(self, inner) -> None:
                self.inner = inner

            def get_shape(self):
                return self.inner.get_shape()

            def __getitem__(self, index):
                return handle._count(name, self.inner[index])

        return Slice(self.handle.get_slice(name))


def _load_rank(monkeypatch, plan, rank: int | None, world_size: int = 2) -> tuple[object, dict[str, int]]:
    """(weights, bytes read per tensor name) of one rank's load (None: the whole model), in this process."""
    counts: dict[str, int] = {}
    original = safetensors_loader.safe_open
    monkeypatch.setattr(safetensors_loader, "safe_open", lambda *a, **k: _CountingHandle(original(*a, **k), counts))
    share = None
    if rank is not None:  # the collectives are not called while loading
        share = TensorParallelWeights(ShardLayout.of(plan.config, rank, world_size), comm=None)  # type: ignore[arg-type]
    model = safetensors_loader.load(plan, "cpu", share)
    monkeypatch.setattr(safetensors_loader, "safe_open", original)
    return model.weights, counts


#: ``LayerWeights`` fields and their checkpoint names under ``model.layers.{i}.``.
LINEARS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def _quantized_linears(weights) -> dict[str, object]:
    """{checkpoint weight name: its loaded weight} of every dense projection (a MoE layer's gate/up/down: its
    shared expert's, ``mlp.shared_expert.*``)."""
    return {
        f"model.layers.{i}.{name.replace('mlp.', 'mlp.shared_expert.') if layer.moe else name}.weight": projection[0]
        for i, layer in enumerate(weights.layers)
        for field, name in LINEARS.items()
        if (projection := getattr(layer, field)) is not None
    }


@pytest.mark.parametrize(
    "model_type, layout",
    [("llama", layout) for layout in FLOAT8 + INT4] + [("qwen3_moe", "fp8-block"), ("qwen2_moe", "gptq")],
)
def test_each_rank_reads_only_its_slices_and_they_dequantize_to_the_whole(monkeypatch, model_type, layout):
    quantized, _ = _quantized(model_type, layout)
    plan, reason = safetensors_loader.load_plan(quantized, "float32")
    assert plan is not None, reason
    stored = {tensor for parts in plan.quantized.values() for tensor in parts.values()}
    whole, whole_counts = _load_rank(monkeypatch, plan, None)
    total = sum(whole_counts[name] for name in stored)
    ranks = [_load_rank(monkeypatch, plan, rank) for rank in range(2)]
    for weights, counts in ranks:
        read = sum(counts.get(name, 0) for name in stored)
        # half of every split tensor; GPTQ's g_idx and compressed-tensors' weight_shape whole where columns split
        assert 0.5 * total <= read <= 0.51 * total, (read, total)
    style_of = registry.family_of(plan.config).shard_style
    rank_weights = [_quantized_linears(weights) for weights, _ in ranks]
    shapes = registry.family_of(plan.config).checkpoint_shapes(plan.config)
    for name, weight in _quantized_linears(whole).items():
        dim = ShardLayout.of(plan.config, 0, 2).split(style_of(name), shapes[name])[0]  # type: ignore[index]
        slices = [linears[name] for linears in rank_weights]
        # the same weight type on each rank, in row-major memory of its own, so a GEMM written for the type runs it
        assert isinstance(weight, (QuantizedWeight, Int4Weight))
        assert all(type(s) is type(weight) and all(_row_major(t) for t in s.tensors()) for s in slices), name
        assert torch.equal(torch.cat([s.dequantize() for s in slices], dim=dim), weight.dequantize()), name
    if model_type != "llama":  # experts whole, half of them on each rank, still quantized
        for (weights, _), experts in zip(ranks, ([0, 1], [2, 3])):
            moe, full = weights.layers[-1].moe, whole.layers[-1].moe  # the last layer is sparse
            assert isinstance(moe.gate_up, QuantizedExperts) and len(moe.gate_up.experts) == 2
            assert torch.equal(moe.gate_up.dequantize(), full.gate_up.dequantize(slice(experts[0], experts[-1] + 1)))


def _row_major(tensor: torch.Tensor) -> bool:
    """Row-major strides, size-1 dimensions included (a one-group slice's (N, 1) zeros and scales alike)."""
    return tensor.stride() == torch.empty(tensor.shape, device="meta").stride()


#: A split each layout cannot make, and the words of its refusal.
MISALIGNED = {
    # down_proj's 320 inputs are 160 per rank: not whole 128-wide blocks
    "fp8-block": (
        dict(intermediate_size=320),
        "model.layers.0.mlp.down_proj.weight does not split on its layout's boundaries: its 320 input features "
        "split into 160 per rank, and a rank's slice must start on a multiple of 128: one scale per 128 x 128 "
        "block (fp8 weight_block_size)",
    ),
    # o_proj's 128 inputs (2 heads of 64) are 64 per rank: not whole groups of 128
    "gptq": (
        dict(hidden_size=128),
        "model.layers.0.self_attn.o_proj.weight does not split on its layout's boundaries: its 128 input features "
        "split into 64 per rank, and a rank's slice must start on a multiple of 128: one scale per group of 128 "
        "inputs (group_size)",
    ),
}


@pytest.mark.parametrize("layout", sorted(MISALIGNED))
def test_a_split_off_the_blocks_or_groups_is_refused_by_name_before_any_rank_starts(layout, monkeypatch):
    from cbrun.engine.worker import tp_group

    changed, named = MISALIGNED[layout]
    quantized, _ = _quantized("llama", layout, **changed)

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(tp_group, "start", no_rank)
    with pytest.raises(
        ValueError, match="tensor_parallel_size = 2 cannot split this model: the quantized weight"
    ) as info:
        LLMEngine.from_pretrained(str(quantized), EngineConfig(dtype="float32", tensor_parallel_size=2))
    assert named in str(info.value)
    # compressed-tensors float8 per channel splits anywhere: the same shapes load
    channel, _ = _quantized("llama", "ct-channel", **changed)
    assert loader.tensor_parallel_plan(str(channel), EngineConfig(dtype="float32", tensor_parallel_size=2))


def test_a_shared_expert_whose_own_width_splits_off_the_blocks_is_refused_by_its_name():
    # the dense layer's 256 features split on 128-wide blocks; the shared expert's 384 would split into 192
    quantized, _ = _quantized("qwen2_moe", "fp8-block", shared_expert_intermediate_size=384)
    with pytest.raises(ValueError, match="cannot split this model: the quantized weight") as info:
        loader.tensor_parallel_plan(str(quantized), EngineConfig(dtype="float32", tensor_parallel_size=2))
    assert (
        "model.layers.1.mlp.shared_expert.down_proj.weight does not split on its layout's boundaries: its 384 input "
        "features split into 192 per rank"
    ) in str(info.value)


def test_int4_zero_points_packed_along_the_rows_need_eight_rows_per_rank():
    config = _quantized_config("gptq")
    # intermediate_size 8: gate_proj's 8 rows split 4 per rank, inside one int32 of packed zero points
    reason = parallel.unsupported_quantized_reason(
        config, {"model.layers.0.mlp.gate_proj.weight": (8, 256)}, lambda name: "column", 2
    )
    assert reason is not None and "its 8 output rows split into 4 per rank" in reason
    assert "multiple of 8: eight zero points per int32 along the output rows (gptq)" in reason
    head = parallel.unsupported_quantized_reason(config, {"lm_head.weight": (128, 256)}, lambda name: "vocab", 2)
    assert head == (
        "the quantized weight lm_head.weight would be split by vocabulary, which cbrun does for unquantized weights only"
    )


def _quantized_config(layout: str):
    from dataclasses import replace

    from cbrun.engine.model.layers.quantization.schemes import read_quantization

    plan, _ = safetensors_loader.load_plan(random_model_dir("llama"), "float32")
    scheme, _ = read_quantization(int4._quantization_config(layout))
    return replace(plan.config, quantization=scheme, intermediate_size=8)


@pytest.mark.parametrize("layout", FLOAT8 + INT4)
def test_the_triton_gemm_runs_each_ranks_slice_unchanged(monkeypatch, layout):
    """The CUDA branch of the quantized linear (``triton_quantized_linear``, Triton's interpreter here) on each
    rank's slice of a column-parallel (gate_proj) and a row-parallel (o_proj: one group of 128 per rank) weight: the
    ranks' products, joined (columns) or summed (rows), equal the whole weight's product on the chunked CPU path."""
    pytest.importorskip("triton")
    from cbrun.engine.model.layers.quantization.base import chunked_quantized_linear, triton_quantized_linear

    quantized, _ = _quantized("llama", layout)
    plan, _ = safetensors_loader.load_plan(quantized, "float32")
    whole = _quantized_linears(_load_rank(monkeypatch, plan, None)[0])
    ranks = [_quantized_linears(_load_rank(monkeypatch, plan, rank)[0]) for rank in range(2)]
    g = torch.Generator().manual_seed(0)
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        weight = whole[name]
        x = torch.randn(3, weight.shape[1], generator=g)
        want = chunked_quantized_linear(x, weight, None)
        if name.endswith("gate_proj.weight"):  # column-parallel: each rank its output features
            got = torch.cat([triton_quantized_linear(x, rank[name], None) for rank in ranks], dim=-1)
        else:  # row-parallel: each rank its input features, the partial sums added (the all-reduce)
            half = weight.shape[1] // 2
            parts = [x[:, r * half : (r + 1) * half].contiguous() for r in range(2)]
            got = sum(triton_quantized_linear(part, rank[name], None) for part, rank in zip(parts, ranks))
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name


def _real(model_type: str, quantization: dict, **fields) -> dict:
    """A config.json of a real checkpoint's shapes (one decoder layer: the check is the same for each)."""
    return dict(
        model_type=model_type,
        vocab_size=151936,
        num_hidden_layers=1,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        quantization_config=quantization,
        **fields,
    )


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
#: Real checkpoints' shapes, the ranks they run on, and the words of a refusal (None: they split).
REAL = {
    # Qwen3-30B-A3B-FP8: 4 KV heads of 128 (replicated at tp 8), 128 experts of 768 held whole
    "qwen3-30b-a3b-fp8": (
        _real(
            "qwen3_moe",
            FP8_CONFIG,
            hidden_size=2048,
            intermediate_size=6144,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            moe_intermediate_size=768,
            num_experts=128,
        ),  # fmt: skip
        (2, 4, 8),
        None,
    ),
    "qwen3-235b-a22b-fp8": (
        _real(
            "qwen3_moe",
            FP8_CONFIG,
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            moe_intermediate_size=1536,
            num_experts=128,
        ),  # fmt: skip
        (4, 8),
        None,
    ),
    # Llama-3-70B in GPTQ int4 group 128: 28672 / 8 = 3584 = 28 groups per rank
    "llama-3-70b-gptq": (
        _real(
            "llama",
            int4._quantization_config("gptq"),
            hidden_size=8192,
            intermediate_size=28672,
            num_attention_heads=64,
            num_key_value_heads=8,
        ),  # fmt: skip
        (2, 4, 8),
        None,
    ),
    # Qwen2-57B-A14B in GPTQ int4 group 128: the shared expert's 20480 features are 80 / 40 groups per rank, split
    # by their own width beside intermediate_size 18944 (no dense layer: unused); 64 experts of 2560 whole
    "qwen2-57b-a14b-gptq": (
        _real(
            "qwen2_moe",
            int4._quantization_config("gptq"),
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            moe_intermediate_size=2560,
            shared_expert_intermediate_size=20480,
            num_experts=64,
            num_experts_per_tok=8,
        ),  # fmt: skip
        (2, 4),
        None,
    ),
    # Qwen2.5-72B's 29568 intermediate features are 115.5 groups of 128 per rank at tp 2 (Qwen's own int4
    # releases pad them to 29696 for this)
    "qwen2.5-72b-awq-unpadded": (
        _real(
            "qwen2",
            int4._quantization_config("awq"),
            hidden_size=8192,
            intermediate_size=29568,
            num_attention_heads=64,
            num_key_value_heads=8,
        ),  # fmt: skip
        (2,),
        "model.layers.0.mlp.down_proj.weight does not split on its layout's boundaries: its 29568 input features "
        "split into 14784 per rank, and a rank's slice must start on a multiple of 128",
    ),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_checkpoints_shapes_split_or_are_refused_by_name(name):
    raw, sizes, refused = REAL[name]
    config, reason = registry.parse_config(raw)
    assert config is not None, reason
    family = registry.family_of(config)
    shapes = family.checkpoint_shapes(config)
    weights = {n: s for n, s in shapes.items() if n.endswith("_proj.weight")}
    for size in sizes:
        assert parallel.unsupported_reason(config, shapes, family.shard_style, size) is None
        reason = parallel.unsupported_quantized_reason(config, weights, family.shard_style, size)
        assert reason is None if refused is None else refused in str(reason), (size, reason)
