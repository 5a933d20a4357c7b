"""The weight-dequantizing Triton GEMMs (int4 group, FP8 block / per-channel, MXFP4) against their PyTorch
reference (dequantize, then ``F.linear``), in Triton's interpreter on the CPU (``tests/conftest.py`` sets
``TRITON_INTERPRET``): a small grid of dtypes, row counts (each of the tile policy's three tiles), ragged N and K,
with and without bias, outputs poisoned first; the dequantized values bit for bit; bad arguments refused by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from cbrun.kernels.fp8_gemm import fp8_matmul_triton  # noqa: E402
from cbrun.kernels.int4_gemm import int4_matmul_triton  # noqa: E402
from cbrun.kernels.mxfp4_gemm import mxfp4_matmul_triton  # noqa: E402
from cbrun.kernels.quantized_reference import (  # noqa: E402
    dequantized_matmul_ref,
    fp8_dequant_ref,
    int4_dequant_ref,
    mxfp4_dequant_ref,
)
from tests.kernels.triton_mode import check_close  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Largest |error| allowed, relative to the largest |reference| value: a few units in the last place of the dtype.
TOLERANCE = {torch.float32: 4e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
#: One row count per tile of ``pick_quantized_gemm_tile``: decode (16 x 32), 17..64 rows, more (64 x 128).
ROWS = (1, 20, 70)


def int4_weight(n: int, k: int, group_size: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, -(-k // 8)), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=g) * 0.1 + 0.01
    return packed, zeros, scales


def fp8_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qweight = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.01 + 0.001
    return qweight, scale


def mxfp4_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 126, (n, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def poisoned(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((rows, cols), float("nan"), dtype=dtype)


def inputs(rows: int, k: int, n: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    return x, (torch.randn(n, generator=g).to(dtype) if bias else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k,group_size,bias", [(40, 256, 128, True), (33, 200, 32, False), (24, 72, 72, True)])
def test_int4_gemm_equals_the_reference(dtype, rows, n, k, group_size, bias):
    packed, zeros, scales = int4_weight(n, k, group_size, n + k)
    x, b = inputs(rows, k, n, dtype, rows, bias)
    got = int4_matmul_triton(x, packed, zeros, scales, k, group_size, b, out=poisoned(rows, n, dtype))
    check_close(
        got, dequantized_matmul_ref(x, int4_dequant_ref(packed, zeros, scales, k, group_size, dtype), b), TOLERANCE
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    "n,k,block,bias",
    [(40, 256, (128, 128), False), (130, 200, (128, 128), True), (33, 300, (1, 300), True), (24, 64, (24, 64), False)],
    ids=["block128", "block128-ragged", "per-channel", "per-tensor"],
)
def test_fp8_gemm_equals_the_reference(dtype, rows, n, k, block, bias):
    qweight, scale = fp8_weight(n, k, block, n + k)
    x, b = inputs(rows, k, n, dtype, rows, bias)
    got = fp8_matmul_triton(x, qweight, scale, block, b, out=poisoned(rows, n, dtype))
    check_close(got, dequantized_matmul_ref(x, fp8_dequant_ref(qweight, scale, block, dtype), b), TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k,bias", [(40, 256, True), (33, 96, False)])
def test_mxfp4_gemm_equals_the_reference(dtype, rows, n, k, bias):
    blocks, scales = mxfp4_weight(n, k, n + k)
    x, b = inputs(rows, k, n, dtype, rows, bias)
    got = mxfp4_matmul_triton(x, blocks, scales, b, out=poisoned(rows, n, dtype))
    check_close(got, dequantized_matmul_ref(x, mxfp4_dequant_ref(blocks, scales, dtype), b), TOLERANCE)


def test_dequantized_values_are_the_references_bit_for_bit():
    """x = I (float32) makes out = W.T exactly: every FP8 code but NaN, every E2M1 code with E8M0 scales 0, 1, 2
    (subnormal powers of two) and up to 200, and every int4 code, come out as their references' values."""
    k = 64
    eye = torch.eye(k)
    qweight = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(4, k)
    finite = ~torch.isnan(qweight.float())
    qweight = torch.where(finite, qweight.float(), 0.0).to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5], [3.0], [2.0**-20], [1.0]])
    got = fp8_matmul_triton(eye, qweight, scale, (1, k)).T
    assert torch.equal(got, fp8_dequant_ref(qweight, scale, (1, k), torch.float32))

    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(8, 2, 16)  # every code, both nibbles
    scales = torch.tensor([0, 1, 2, 127, 200, 130, 120, 100], dtype=torch.uint8)[:, None].repeat(1, 2)
    got = mxfp4_matmul_triton(eye, blocks, scales).T
    assert torch.equal(got, mxfp4_dequant_ref(blocks, scales, torch.float32))  # (a sum turns -0.0 into 0.0)

    packed, zeros, scales4 = int4_weight(16, k, 32, 0)
    got = int4_matmul_triton(eye, packed, zeros, scales4, k, 32).T
    assert torch.equal(got, int4_dequant_ref(packed, zeros, scales4, k, 32, torch.float32))


def test_references_equal_the_engine_weight_types():
    """The kernels' references are the engine's own dequantizations (``Int4Weight``, ``QuantizedWeight``)."""
    from cbrun.engine.model.layers.quantization.fp8 import QuantizedWeight, dequantize
    from cbrun.engine.model.layers.quantization.int4 import Int4Weight

    packed, zeros, scales = int4_weight(24, 200, 32, 3)
    engine = Int4Weight(packed, zeros, scales, 200, 32, torch.bfloat16)
    assert torch.equal(engine.dequantize_reference(), int4_dequant_ref(packed, zeros, scales, 200, 32, torch.bfloat16))
    qweight, scale = fp8_weight(130, 200, (128, 128), 4)
    fp8 = QuantizedWeight(qweight, scale, (128, 128), torch.float16)
    assert torch.equal(dequantize(fp8), fp8_dequant_ref(qweight, scale, (128, 128), torch.float16))


def test_refusals_name_the_argument():
    x = torch.randn(2, 64)
    packed, zeros, scales = int4_weight(16, 64, 32, 0)
    with pytest.raises(ValueError, match="int4 group_size 8 is not a multiple of 16"):
        int4_matmul_triton(x, packed, *int4_weight(16, 64, 8, 0)[1:], 64, 8)
    with pytest.raises(ValueError, match="zeros must be torch.uint8 of shape"):
        int4_matmul_triton(x, packed, zeros[:, :1], scales, 64, 32)
    with pytest.raises(ValueError, match="x has 63 features"):
        int4_matmul_triton(x[:, :63], packed, zeros, scales, 64, 32)
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        int4_matmul_triton(torch.randn(64, 2).T, packed, zeros, scales, 64, 32)
    with pytest.raises(ValueError, match="x dtype must be one of"):
        int4_matmul_triton(x.to(torch.float64), packed, zeros, scales, 64, 32)
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        int4_matmul_triton(x, packed, zeros, scales, 64, 32, bias=torch.zeros(16, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        int4_matmul_triton(x, packed, zeros, scales, 64, 32, out=torch.empty(2, 15))

    qweight, scale = fp8_weight(16, 64, (16, 24), 0)
    with pytest.raises(ValueError, match="fp8 scale block bi 24 is not a multiple of 16"):
        fp8_matmul_triton(x, qweight, scale, (16, 24))
    with pytest.raises(ValueError, match="scale must be float32 of shape"):
        fp8_matmul_triton(x, qweight, scale, (16, 32))
    with pytest.raises(ValueError, match="qweight must be torch.float8_e4m3fn"):
        fp8_matmul_triton(x, qweight.to(torch.bfloat16), scale, (16, 24))

    blocks, mx_scales = mxfp4_weight(16, 64, 0)
    with pytest.raises(ValueError, match="K = 48 is not a multiple of the MXFP4 block of 32"):
        mxfp4_matmul_triton(torch.randn(2, 48), blocks.reshape(16, -1)[:, :24], mx_scales[:, :1])
    with pytest.raises(ValueError, match="scales must be torch.uint8 of shape"):
        mxfp4_matmul_triton(x, blocks, mx_scales.to(torch.int32))
    with pytest.raises(ValueError, match="MXFP4 blocks must be"):
        mxfp4_matmul_triton(x, blocks.reshape(16, 2, 4, 4), mx_scales)


def test_empty_batch_launches_nothing():
    packed, zeros, scales = int4_weight(16, 64, 32, 0)
    assert int4_matmul_triton(torch.randn(0, 64), packed, zeros, scales, 64, 32).shape == (0, 16)


def test_strided_rows_of_x_and_out():
    """x and out may be row slices of wider buffers (a fused projection's output columns, a padded batch)."""
    n, k = 40, 256
    x = torch.randn(5, k + 24)[:, 8 : 8 + k]
    packed, zeros, scales = int4_weight(n, k, 128, 1)
    qweight, scale = fp8_weight(n, k, (128, 128), 1)
    blocks, e8m0 = mxfp4_weight(n, k, 1)
    runs = (
        (lambda out: int4_matmul_triton(x, packed, zeros, scales, k, 128, out=out), int4_dequant_ref(packed, zeros, scales, k, 128, torch.float32)),
        (lambda out: fp8_matmul_triton(x, qweight, scale, (128, 128), out=out), fp8_dequant_ref(qweight, scale, (128, 128), torch.float32)),
        (lambda out: mxfp4_matmul_triton(x, blocks, e8m0, out=out), mxfp4_dequant_ref(blocks, e8m0, torch.float32)),
    )  # fmt: skip
    for run, real in runs:
        buffer = torch.full((5, n + 16), float("nan"))
        run(buffer[:, 16:])
        check_close(buffer[:, 16:], dequantized_matmul_ref(x, real), TOLERANCE)
        assert torch.isnan(buffer[:, :16]).all()  # nothing written outside out
