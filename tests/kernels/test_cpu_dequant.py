"""The C dequantization kernels (``cbrun.kernels.cpu_dequant``) give their PyTorch references' bits, over ragged
shapes, block and group sizes and chunk starts, outputs poisoned first (a value the kernel fails to write shows)."""

from __future__ import annotations

import pytest
import torch

from cbrun.engine.model.layers.quantization.fp8 import QuantizedWeight, dequantize
from cbrun.engine.model.layers.quantization.int4 import Int4Weight
from cbrun.kernels import cpu_dequant

pytestmark = pytest.mark.skipif(cpu_dequant.unavailable_reason() is not None, reason="no C compiler")


@pytest.mark.parametrize("shape", [(256, 256), (300, 200), (5, 1000), (129, 7)])
@pytest.mark.parametrize("block", [(128, 128), (1, 200), (64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_dequant_equals_the_reference(shape, block, dtype, monkeypatch):
    g = torch.Generator().manual_seed(shape[0] * 7 + block[1])
    values = (torch.randn(shape, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-shape[0] // block[0]), -(-shape[1] // block[1]), generator=g) + 0.5
    weight = QuantizedWeight(values, scale, block, dtype)
    poisoned = torch.empty  # the kernel's output is torch.empty: fill it with NaN first
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(*a, **k).fill_(float("nan")))
    for start in range(0, shape[0], block[0]):
        stop = min(shape[0], start + 2 * block[0])
        got = weight.dequantize(start, stop)
        assert got.dtype == dtype and torch.equal(got, dequantize(weight, start, stop))


@pytest.mark.parametrize(
    "out_features,in_features,group_size", [(64, 256, 128), (33, 300, 128), (8, 96, 32), (3, 17, 17)]
)
@pytest.mark.parametrize("start,stop", [(0, None), (1, 3)])
def test_int4_dequant_equals_the_reference(out_features, in_features, group_size, start, stop, monkeypatch):
    from cbrun.engine.model.layers.quantization.int4 import pack_rows

    g = torch.Generator().manual_seed(in_features)
    groups = -(-in_features // group_size)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g)
    zeros = torch.randint(0, 16, (out_features, groups), generator=g).to(torch.uint8)
    scales = torch.rand(out_features, groups, generator=g) + 0.01
    weight = Int4Weight(pack_rows(codes), zeros, scales, in_features, group_size, torch.float32)
    poisoned = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(*a, **k).fill_(float("nan")))
    got = weight.dequantize(start, stop)
    assert torch.equal(got, weight.dequantize_reference(start, stop))
    want = (codes - zeros.long()[:, torch.arange(in_features) // group_size]).float()
    want = want * scales[:, torch.arange(in_features) // group_size]
    assert torch.equal(got, want[start:stop])


def test_non_contiguous_or_non_cpu_inputs_leave_it_to_the_reference():
    values = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    assert cpu_dequant.fp8_block_dequant(values.T, torch.ones(1, 1), (8, 4), 0, 8) is None
    assert cpu_dequant.fp8_block_dequant(values, torch.ones(1, 1), (4, 8), 0, 4) is not None


def _mxfp4(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks (rows, cols / 32, 16) and E8M0 scales with every code 0..255 among them."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (rows, cols // 32), generator=g, dtype=torch.uint8)
    flat = scales.view(-1)
    flat[: min(256, flat.numel())] = torch.arange(min(256, flat.numel()), dtype=torch.uint8)  # 0, 1, 254, 255 too
    return blocks, scales


@pytest.mark.parametrize("rows,cols", [(4, 32), (9, 96), (64, 256), (3, 2880)])
@pytest.mark.parametrize("start,stop", [(0, None), (1, 3)])
def test_mxfp4_dequant_equals_the_reference_bit_for_bit(rows, cols, start, stop, monkeypatch):
    from cbrun.kernels.quantized_reference import mxfp4_dequant_ref

    blocks, scales = _mxfp4(rows, cols, rows * cols)
    stop = rows if stop is None else stop
    poisoned = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(*a, **k).fill_(float("nan")))
    got = cpu_dequant.mxfp4_dequant(blocks.reshape(rows, -1), scales, start, stop)
    want = mxfp4_dequant_ref(blocks, scales, torch.float32)[start:stop]
    assert got is not None and got.shape == (stop - start, cols)
    # NaN-aware bit equality: 0 * 2^128 style NaNs do not arise (ldexp keeps zeros), so plain equal must hold.
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_reference_equals_transformers_dequantization(dtype):
    """The reference is transformers' own gpt-oss dequantization (``convert_moe_packed_tensors``, which stacks the
    experts and returns each transposed to (K, N)), bit for bit, with every E8M0 code present."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    from cbrun.kernels.quantized_reference import mxfp4_dequant_ref

    experts = [_mxfp4(8, 128, seed) for seed in range(8)]  # 8 experts x 8 rows x 4 groups: 256 scales
    blocks = torch.stack([b for b, _ in experts])
    scales = torch.stack([s for _, s in experts])
    scales.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (E, K, N)
    ours = torch.stack([mxfp4_dequant_ref(blocks[e], scales[e], dtype) for e in range(len(experts))])
    assert torch.equal(ours.transpose(1, 2).float().nan_to_num(), theirs.float().nan_to_num())
    assert torch.isinf(ours.float()).any()  # the code 255 reached (6 * 2^128 overflows, as in transformers)


def test_mxfp4_dequant_leaves_other_inputs_to_the_reference():
    blocks, scales = _mxfp4(4, 64, 0)
    assert cpu_dequant.mxfp4_dequant(blocks.reshape(4, -1), scales[:, :1].contiguous(), 0, 4) is None
    assert cpu_dequant.mxfp4_dequant(blocks.reshape(4, -1).to(torch.int32), scales, 0, 4) is None
