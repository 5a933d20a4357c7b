"""``quantized_matmul``: the CPU path (C dequantization chunk by chunk, or the PyTorch reference) and the Triton
path (interpreted here) both equal the dequantize-then-matmul reference; layouts refuse bad tensors when built;
the W8A8 ``torch._scaled_mm`` choice is opt-in, matches its own float32 reference, and is refused by name where it
cannot run."""

from __future__ import annotations

import pytest
import torch

from cbrun.kernels import cpu_dequant
from cbrun.kernels import fp8_scaled_mm as fp8_scaled_mm_module
from cbrun.kernels import quantized_matmul as qm
from cbrun.kernels.fp8_scaled_mm import (
    cpu_scaled_mm_unavailable_reason,
    fp8_scaled_mm,
    fp8_scaled_mm_ref,
    quantize_per_token,
    select_fp8_gemm,
)
from cbrun.kernels.gpu_check_quantized import make_layouts
from cbrun.kernels.quantized_matmul import Fp8Layout, Int4Layout, Mxfp4Layout, quantized_matmul
from cbrun.kernels.quantized_reference import (
    dequantized_matmul_ref,
    fp8_dequant_ref,
    int4_dequant_ref,
)

TOLERANCE = {torch.float32: 4e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


#: {kernel name: (layout, its real weight in float32)}: the GPU check's layouts (int4 group 128, FP8 128 x 128
#: blocks and per channel, MXFP4) at a small shape.
LAYOUTS = make_layouts(48, 256, "cpu", seed=48 * 256)


def check_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    peak = want.float().abs().max().item()
    assert peak > 0 and (got.float() - want.float()).abs().max().item() <= TOLERANCE[want.dtype] * peak


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_both_paths_equal_the_reference(name, dtype, backend, monkeypatch):
    """The CPU path in several chunks (a chunk of 1000 elements is 3 rows here) and the interpreted Triton path,
    with leading dims and a bias."""
    layout, real = LAYOUTS[name]
    monkeypatch.setattr(qm, "CPU_CHUNK_ELEMENTS", 1000)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, real.shape[1], generator=g).to(dtype)
    bias = torch.randn(real.shape[0], generator=g).to(dtype)
    got = quantized_matmul(x, layout, bias, backend=backend)
    assert got.shape == (2, 3, real.shape[0])
    check_close(got.reshape(6, -1), dequantized_matmul_ref(x.reshape(6, -1), real.to(dtype), bias))


def test_cpu_path_without_the_c_kernels_runs_the_reference(monkeypatch):
    for name in ("int4_dequant", "fp8_block_dequant", "mxfp4_dequant"):
        monkeypatch.setattr(cpu_dequant, name, lambda *a, **k: None)
    x = torch.randn(4, 256)
    for layout, real in LAYOUTS.values():
        check_close(quantized_matmul(x, layout), dequantized_matmul_ref(x, real))


def test_cpu_path_dequantizes_chunk_by_chunk(monkeypatch):
    """Never more than about CPU_CHUNK_ELEMENTS weight elements at once: the whole weight is never built."""
    monkeypatch.setattr(qm, "CPU_CHUNK_ELEMENTS", 2048)
    seen = []
    layout, real = LAYOUTS["int4_gemm g128"]
    original = Int4Layout.dequantize
    monkeypatch.setattr(Int4Layout, "dequantize", lambda self, a, b, d: seen.append(b - a) or original(self, a, b, d))
    x = torch.randn(3, 256)
    check_close(quantized_matmul(x, layout), dequantized_matmul_ref(x, real))
    assert seen == [8] * 6 and sum(seen) == real.shape[0]


def test_layouts_refuse_bad_tensors_by_name():
    layout, _ = LAYOUTS["int4_gemm g128"]
    with pytest.raises(ValueError, match="Int4Layout: zeros must be torch.uint8"):
        Int4Layout(layout.packed, layout.zeros.int(), layout.scales, 256, 128)
    with pytest.raises(ValueError, match="Int4Layout: packed must be torch.int32 of shape"):
        Int4Layout(layout.packed, layout.zeros, layout.scales, 300, 128)
    fp8, _ = LAYOUTS["fp8_gemm block128"]
    with pytest.raises(ValueError, match=r"Fp8Layout: scale must be float32 of shape \(1, 4\)"):
        Fp8Layout(fp8.qweight, fp8.scale, (128, 64))
    mx, _ = LAYOUTS["mxfp4_gemm"]
    with pytest.raises(ValueError, match="Mxfp4Layout: scales must be torch.uint8"):
        Mxfp4Layout(mx.blocks, mx.scales[:, :3])
    with pytest.raises(ValueError, match="x has 255 features"):
        quantized_matmul(torch.randn(2, 255), mx)
    with pytest.raises(ValueError, match="backend must be one of"):
        quantized_matmul(torch.randn(2, 256), mx, backend="cuda")


def test_triton_path_refuses_a_group_it_cannot_step_that_the_cpu_path_runs():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 2**31 - 1, (16, 8), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (16, 8), generator=g, dtype=torch.uint8)
    layout = Int4Layout(packed, zeros, torch.rand(16, 8, generator=g), 64, 8)
    x = torch.randn(2, 64, generator=g)
    want = dequantized_matmul_ref(x, int4_dequant_ref(packed, zeros, layout.scales, 64, 8, torch.float32))
    check_close(quantized_matmul(x, layout), want)
    with pytest.raises(ValueError, match="int4 group_size 8 is not a multiple of 16.*CPU path"):
        quantized_matmul(x, layout, backend="triton")


# --- FP8 W8A8 (torch._scaled_mm), opt-in ---------------------------------------------------------------------


def test_selection_is_weight_only_by_default_and_refuses_dynamic_by_name():
    bf16, shape = torch.bfloat16, (256, 256)
    assert select_fp8_gemm("none", None, bf16, (128, 128), shape) == "weight_only"
    assert select_fp8_gemm("none", 80, torch.float32, (128, 128), shape) == "weight_only"
    assert select_fp8_gemm("dynamic", 90, bf16, (1, 256), shape) == "scaled_mm"
    assert select_fp8_gemm("dynamic", 89, bf16, (256, 256), shape) == "scaled_mm"  # per-tensor
    assert select_fp8_gemm("dynamic", None, bf16, (1, 256), shape) == "scaled_mm"  # the CPU: PyTorch's own
    with pytest.raises(ValueError, match=r'fp8_activation_scheme = "dynamic".*needs FP8 tensor cores .* on sm_80'):
        select_fp8_gemm("dynamic", 80, bf16, (1, 256), shape)
    with pytest.raises(ValueError, match="not the 128 x 128 block layout"):
        select_fp8_gemm("dynamic", 90, bf16, (128, 128), shape)
    with pytest.raises(ValueError, match="not the 1 x 128 block layout"):  # per-row groups narrower than K
        select_fp8_gemm("dynamic", 90, bf16, (1, 128), shape)
    with pytest.raises(ValueError, match="bf16 activations only.*runs float16"):
        select_fp8_gemm("dynamic", 90, torch.float16, (1, 256), shape)
    with pytest.raises(ValueError, match="bf16 activations only.*runs float32"):
        select_fp8_gemm("dynamic", None, torch.float32, (1, 256), shape)
    with pytest.raises(ValueError, match="multiple of 16, and a weight is 256 x 40"):
        select_fp8_gemm("dynamic", 90, bf16, (1, 40), (256, 40))
    with pytest.raises(ValueError, match="fp8_activation_scheme must be one of"):
        select_fp8_gemm("static", 90, bf16, (1, 256), shape)


def test_the_cpu_is_refused_only_where_torch_cannot_run_scaled_mm(monkeypatch):
    assert cpu_scaled_mm_unavailable_reason() is None  # torch 2.13's CPU build runs it
    monkeypatch.setattr(fp8_scaled_mm_module, "cpu_scaled_mm_unavailable_reason", lambda: "no float8 GEMM")
    with pytest.raises(ValueError, match=r"does not run on the CPU with this torch \(no float8 GEMM\)"):
        select_fp8_gemm("dynamic", None, torch.bfloat16, (1, 256), (256, 256))


def test_dynamic_scheme_runs_scaled_mm_on_the_cpu_through_the_dispatch():
    layout, _ = LAYOUTS["fp8_gemm channel"]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = quantized_matmul(x, layout, fp8_activation_scheme="dynamic")
    assert torch.equal(got, fp8_scaled_mm(x, layout.qweight, layout.scale))
    assert not torch.equal(got, quantized_matmul(x, layout))  # weight-only differs: the activations were rounded
    with pytest.raises(ValueError, match="not the 128 x 128 block layout"):
        quantized_matmul(x, LAYOUTS["fp8_gemm block128"][0], fp8_activation_scheme="dynamic")
    with pytest.raises(ValueError, match="fp8_activation_scheme must be one of"):
        quantized_matmul(torch.randn(2, 256), LAYOUTS["int4_gemm g128"][0], fp8_activation_scheme="W8A8")
    with pytest.raises(ValueError, match="quantizes the activations of FP8 weights, and this weight is an Int4Layout"):
        quantized_matmul(torch.randn(2, 256).bfloat16(), LAYOUTS["int4_gemm g128"][0], fp8_activation_scheme="dynamic")


def test_per_token_quantization():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -448.0, 2.0], [1e-3, 2e-3, -4e-3]])
    xq, scale = quantize_per_token(x)
    assert xq.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    assert not torch.isnan(xq.float()).any() and xq.float()[0].eq(0).all()  # an all-zero row stays zero
    assert xq.float().abs().amax(dim=1)[1:].eq(448).all()  # each row's largest value maps to 448
    assert torch.allclose(xq.float() * scale, x, rtol=0.07, atol=0)


@pytest.mark.parametrize("scale_shape", [(48, 1), (48,), (1,)])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_matches_its_float32_reference(scale_shape, bias):
    """``torch._scaled_mm`` (PyTorch runs it on the CPU too) gives ``fp8_scaled_mm_ref``'s arithmetic; against the
    weight-only oracle it differs (the activations are rounded to float8), by a few percent at most."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g).bfloat16()
    qweight = (torch.randn(48, 64, generator=g) * 30).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape, generator=g) * 0.01 + 0.001
    b = torch.randn(48, generator=g).bfloat16() if bias else None
    got = fp8_scaled_mm(x, qweight, scale, b)
    want = fp8_scaled_mm_ref(x, qweight, scale, b)
    assert got.dtype == torch.bfloat16 and (got.float() - want.float()).abs().max() <= 8e-3 * want.float().abs().max()
    block = (1, 64) if scale.numel() > 1 else (48, 64)
    oracle = dequantized_matmul_ref(x, fp8_dequant_ref(qweight, scale.reshape(-1, 1)[: -(-48 // block[0])], block,
                                                       torch.bfloat16), b)  # fmt: skip
    error = (got.float() - oracle.float()).abs().max() / oracle.float().abs().max()
    assert 0 < error < 0.05


def test_scaled_mm_refuses_what_it_cannot_take():
    qweight = torch.zeros(48, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="x must be"):
        fp8_scaled_mm(torch.randn(2, 64), qweight, torch.ones(1))
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_scaled_mm(torch.randn(2, 40).bfloat16(), torch.zeros(48, 40, dtype=torch.float8_e4m3fn), torch.ones(1))
    with pytest.raises(ValueError, match="per-channel or per-tensor"):
        fp8_scaled_mm(torch.randn(2, 64).bfloat16(), qweight, torch.ones(1, 2))
