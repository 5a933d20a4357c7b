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
