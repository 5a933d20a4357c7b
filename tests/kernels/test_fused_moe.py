"""The fused MoE Triton kernel (``cbrun.kernels.fused_moe``) against its PyTorch reference and the lean MoE's, in
Triton's interpreter on the CPU (``tests/conftest.py`` sets ``TRITON_INTERPRET``): dense and quantized experts
(int4 group, FP8 block, MXFP4), fp16/bf16/fp32, routings that leave experts with no pair, one pair and every pair,
SiLU and gpt-oss's clamped SwiGLU with biases on interleaved gate/up columns; intermediate buffers poisoned first."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from cbrun.kernels import fused_moe  # noqa: E402
from cbrun.kernels.fused_moe import (  # noqa: E402
    ExpertWeights,
    expert_tile_map,
    fused_moe_reference,
    fused_moe_triton,
    num_row_tiles,
)
from tests.kernels.test_quantized_gemm import fp8_weight, int4_weight, mxfp4_weight  # noqa: E402
from tests.kernels.triton_mode import check_close  # noqa: E402

#: Largest |error| relative to the largest |reference| value: a few units in the last place of the dtype (the
#: intermediates are rounded to it twice, as the reference rounds them).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
E, HIDDEN, WIDTH = 4, 64, 32


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """Every intermediate buffer starts as NaN: a row the kernel never writes shows in the output."""

    def empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(fused_moe, "_empty", empty)


def routing(name: str, tokens: int, top_k: int, seed: int) -> torch.Tensor:
    """(T, k) expert ids: ``spread`` (random, distinct per token), ``one-idle`` (expert 0 gets no pair, expert 1
    exactly one), ``all-one`` (every token's first slot on expert 2: one group holds all tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    if name == "one-idle":
        ids = torch.stack([torch.randperm(E - 2, generator=g)[:top_k] + 2 for _ in range(tokens)])
        ids[0, 0] = 1
    elif name == "all-one":
        ids[:, 0] = 2
        ids[:, 1:] = torch.where(ids[:, 1:] == 2, 3, ids[:, 1:])
    return ids


def make_weights(fmt: str, e: int, n: int, k: int, dtype: torch.dtype, seed: int) -> ExpertWeights:
    """Random experts of one projection (E, n, k) in ``fmt``."""
    if fmt == "dense":
        g = torch.Generator().manual_seed(seed)
        return ExpertWeights("dense", (torch.randn(e, n, k, generator=g) / k**0.5).to(dtype))
    if fmt == "int4":
        parts = [int4_weight(n, k, 32, seed + i) for i in range(e)]
        packed, zeros, scales = (torch.stack(t) for t in zip(*parts))
        return ExpertWeights("int4", packed, scales / 8, zeros, k, (1, 32))
    if fmt == "fp8":
        parts = [fp8_weight(n, k, (16, 32), seed + i) for i in range(e)]
        qweight, scale = (torch.stack(t) for t in zip(*parts))
        return ExpertWeights("fp8", qweight, scale, None, k, (16, 32))
    parts = [mxfp4_weight(n, k, seed + i) for i in range(e)]
    blocks, scales = (torch.stack(t) for t in zip(*parts))
    return ExpertWeights("mxfp4", blocks, scales - 2)


def run_both(x, weights, ids, gate, up, down, **kwargs):
    got = fused_moe_triton(x, weights, ids, gate, up, down, **kwargs)
    dense = [w.dequantize(x.dtype) for w in (gate, up, down)]
    return got, fused_moe_reference(x, weights, ids, *dense, **kwargs)


@pytest.mark.parametrize("fmt", ["dense", "int4", "fp8", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,top_k,route", [(1, 2, "spread"), (5, 2, "one-idle"), (6, 1, "all-one")])
def test_fused_moe_equals_the_reference(fmt, dtype, tokens, top_k, route):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    ids = routing(route, tokens, top_k, tokens)
    weights = torch.rand(tokens, top_k, generator=g)
    if dtype == torch.bfloat16:  # the routing weights in the model dtype (Qwen3-MoE): a bf16 product
        weights = weights.to(dtype)
    gate_up = make_weights(fmt, E, 2 * WIDTH, HIDDEN, dtype, 1)
    half = {"data": gate_up.data[:, :WIDTH]}, {"data": gate_up.data[:, WIDTH:]}
    if fmt == "fp8":  # scale blocks of 16 rows: the two halves are whole blocks
        half[0]["scales"], half[1]["scales"] = gate_up.scales[:, : WIDTH // 16], gate_up.scales[:, WIDTH // 16 :]
    elif fmt != "dense":
        half[0]["scales"], half[1]["scales"] = gate_up.scales[:, :WIDTH], gate_up.scales[:, WIDTH:]
    if fmt == "int4":
        half[0]["zeros"], half[1]["zeros"] = gate_up.zeros[:, :WIDTH], gate_up.zeros[:, WIDTH:]
    gate, up = (ExpertWeights(fmt, in_features=gate_up.in_features, block=gate_up.block, **part) for part in half)
    down = make_weights(fmt, E, HIDDEN, WIDTH, dtype, 2)
    got, want = run_both(x, weights, ids, gate, up, down)
    check_close(got, want, TOLERANCE)


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpt_oss_activation_with_biases_on_interleaved_columns(fmt, dtype):
    """gpt-oss: gate/up interleaved (strided views of one stack), expert biases, clamped SwiGLU, the top-k
    softmax weights in the model dtype; large inputs so the clamps at +-limit bite."""
    tokens, top_k = 5, 2
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(tokens, HIDDEN, generator=g) * 4).to(dtype)
    ids = routing("one-idle", tokens, top_k, 5)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1).to(dtype)
    gate_up = make_weights(fmt, E, 2 * WIDTH, HIDDEN, dtype, 4)
    views = [dict(data=gate_up.data[:, i::2]) for i in (0, 1)]
    if fmt == "mxfp4":
        for i, view in enumerate(views):
            view["scales"] = gate_up.scales[:, i::2]
    gate, up = (ExpertWeights(fmt, **view) for view in views)
    down = make_weights(fmt, E, HIDDEN, WIDTH, dtype, 5)
    bias = (torch.randn(E, 2 * WIDTH, generator=g) * 2).to(dtype)
    down_bias = torch.randn(E, HIDDEN, generator=g).to(dtype)
    kwargs = dict(activation="swiglu_oai", gate_bias=bias[:, 0::2], up_bias=bias[:, 1::2], down_bias=down_bias)
    got, want = run_both(x, weights, ids, gate, up, down, **kwargs)
    check_close(got, want, TOLERANCE)
    plain, _ = run_both(x, weights, ids, gate, up, down)
    assert not torch.allclose(plain, got)  # the activation and biases changed the result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_the_lean_moe_reference(dtype):
    """The kernel under the lean MoE's own routing equals ``sparse_moe_reference`` (transformers' order)."""
    from cbrun.engine.model.layers.moe import MoEWeights, route, sparse_moe_reference

    g = torch.Generator().manual_seed(7)
    moe = MoEWeights(
        router=torch.randn(E, HIDDEN, generator=g).to(dtype),
        gate_up=(torch.randn(E, 2 * WIDTH, HIDDEN, generator=g) / 8).to(dtype),
        down=(torch.randn(E, HIDDEN, WIDTH, generator=g) / 6).to(dtype),
        top_k=2,
        norm_topk_prob=True,
        weights_in_model_dtype=dtype == torch.bfloat16,
    )
    x = torch.randn(9, HIDDEN, generator=g).to(dtype)
    weights, ids = route(x, moe)
    gate, up = ExpertWeights("dense", moe.gate_up[:, :WIDTH]), ExpertWeights("dense", moe.gate_up[:, WIDTH:])
    got = fused_moe_triton(x, weights, ids, gate, up, ExpertWeights("dense", moe.down))
    check_close(got, sparse_moe_reference(x, moe), TOLERANCE)


def test_tile_map_covers_every_pair_once_in_static_shape():
    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [3, 2], [3, 1]])
    block_m = 2
    order, tile_map = expert_tile_map(ids, 5, block_m)
    assert tile_map.shape == (3, num_row_tiles(10, 5, block_m)) == (3, 10)
    assert torch.equal(ids.reshape(-1)[order.long()], ids.reshape(-1).sort(stable=True).values)
    rows = [r for e, first, end in tile_map.T.tolist() for r in range(first, end if end > first else first)]
    covered = sorted(r for e, first, end in tile_map.T.tolist() for r in range(first, min(end, first + block_m)))
    assert covered == list(range(10)) and len(rows) >= 10
    for e, first, end in tile_map.T.tolist():
        if end > first:
            assert all(ids.reshape(-1)[order[r]] == e for r in range(first, min(end, first + block_m)))
    assert (tile_map[2] <= tile_map[1]).sum() > 0  # unused tiles at the end: empty, the kernel exits


def test_refusals_name_the_argument():
    x = torch.randn(3, HIDDEN)
    gate = make_weights("dense", E, WIDTH, HIDDEN, torch.float32, 1)
    down = make_weights("dense", E, HIDDEN, WIDTH, torch.float32, 2)
    ids, weights = torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    with pytest.raises(ValueError, match="dense experts must be torch.bfloat16"):
        fused_moe_triton(x.bfloat16(), weights, ids, gate, gate, down)
    with pytest.raises(ValueError, match="expert_ids must be"):
        fused_moe_triton(x, weights, ids.int(), gate, gate, down)
    with pytest.raises(ValueError, match="activation must be one of"):
        fused_moe_triton(x, weights, ids, gate, gate, down, activation="gelu")
    with pytest.raises(ValueError, match="gate/up must be"):
        fused_moe_triton(x, weights, ids, gate, gate, gate)
    with pytest.raises(ValueError, match="fp8 scales must be"):
        ExpertWeights("fp8", torch.zeros(E, 8, 32, dtype=torch.float8_e4m3fn), torch.ones(E, 1, 2), None, 32, (8, 32))
    bad = ExpertWeights(
        "int4",
        torch.zeros(1, 8, 8, dtype=torch.int32),
        torch.ones(1, 8, 8),
        torch.zeros(1, 8, 8, dtype=torch.uint8),
        64,
        (1, 8),
    )
    with pytest.raises(ValueError, match="int4 group_size 8 is not a multiple of 16"):
        bad.block_k_cap


def test_no_tokens_launches_nothing():
    gate = make_weights("dense", E, WIDTH, HIDDEN, torch.float32, 1)
    down = make_weights("dense", E, HIDDEN, WIDTH, torch.float32, 2)
    out = fused_moe_triton(
        torch.empty(0, HIDDEN), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64), gate, gate, down
    )
    assert out.shape == (0, HIDDEN)
