"""The quantized linear layer's CUDA branch: the Triton GEMMs that dequantize in their inner loop
(``triton_quantized_linear`` over ``cbrun.kernels.quantized_matmul``), run here in Triton's interpreter on the CPU.
A layer's product equals the chunked CPU path's; a whole random model run through the Triton path (the projection
function swapped in at build) gives transformers' greedy tokens on the same weights dequantized."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from cbrun.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from cbrun.engine.model.layers import linear  # noqa: E402
from cbrun.engine.model.layers.quantization.base import (  # noqa: E402
    chunked_quantized_linear,
    quantized_linear,
    triton_quantized_linear,
)
from cbrun.engine.model.layers.quantization.fp8 import QuantizedWeight  # noqa: E402
from cbrun.engine.model.layers.quantization.int4 import Int4Weight, pack_rows  # noqa: E402
from cbrun.kernels import quantized_matmul  # noqa: E402
from tests.engine.model import test_int4_quantization as int4_tests  # noqa: E402
from tests.engine.model import test_quantization as fp8_tests  # noqa: E402
from tests.model_utils import hf_greedy, random_model_dir, random_prompts  # noqa: E402

TOLERANCE = {torch.float32: 4e-6, torch.bfloat16: 1.6e-2}


def _int4(out_features: int, in_features: int, group: int, dtype: torch.dtype) -> Int4Weight:
    g = torch.Generator().manual_seed(out_features + group)
    groups = -(-in_features // group)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g)
    zeros = torch.randint(0, 16, (out_features, groups), generator=g).to(torch.uint8)
    return Int4Weight(pack_rows(codes), zeros, torch.rand(out_features, groups, generator=g) * 0.1, in_features,
                      group, dtype)  # fmt: skip


def _fp8(out_features: int, in_features: int, block: tuple[int, int], dtype: torch.dtype) -> QuantizedWeight:
    g = torch.Generator().manual_seed(out_features + block[0])
    values = (torch.randn(out_features, in_features, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-out_features // block[0]), -(-in_features // block[1]), generator=g) * 0.01
    return QuantizedWeight(values, scale, block, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "make",
    [
        lambda d: _int4(40, 320, 128, d),
        lambda d: _int4(24, 96, 32, d),
        lambda d: _fp8(130, 256, (128, 128), d),
        lambda d: _fp8(48, 200, (1, 200), d),
    ],
    ids=["int4-g128-ragged", "int4-g32", "fp8-block", "fp8-channel"],
)
def test_triton_layer_equals_the_chunked_cpu_path(make, dtype):
    weight = make(dtype)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, weight.shape[1], generator=g).to(dtype)
    bias = torch.randn(weight.shape[0], generator=g).to(dtype)
    want = chunked_quantized_linear(x, weight, bias)
    got = triton_quantized_linear(x, weight, bias)
    assert got.dtype == dtype and got.shape == want.shape
    peak = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype] * peak
    assert weight.kernel_layout is weight.kernel_layout  # built once


def test_a_group_the_triton_gemm_cannot_step_runs_chunked_on_cuda(monkeypatch):
    """An int4 group of 8 (not a multiple of 16): ``quantized_linear`` keeps it on the chunked path rather than
    fail in the kernel's wrapper (here the CUDA branch is entered by faking the device type)."""
    weight = _int4(16, 64, 8, torch.float32)
    assert (
        quantized_matmul.triton_unsupported_reason(weight.kernel_layout) == "int4 group_size 8 is not a multiple of 16"
    )
    assert quantized_matmul.triton_unsupported_reason(_int4(16, 64, 32, torch.float32).kernel_layout) is None

    class FakeCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda")

    x = torch.randn(2, 64)
    calls = []
    monkeypatch.setattr(
        "cbrun.engine.model.layers.quantization.base.triton_quantized_linear", lambda *a: calls.append(a)
    )
    out = quantized_linear(x.as_subclass(FakeCuda), weight, None)
    assert not calls and torch.allclose(out.as_subclass(torch.Tensor), chunked_quantized_linear(x, weight, None))


@pytest.mark.parametrize("suite,layout", [(int4_tests, "ct-asym"), (fp8_tests, "fp8-block")])
def test_greedy_through_the_triton_path_equals_generate_on_the_dequantized_weights(suite, layout, monkeypatch):
    """Every projection of a random quantized Llama runs the Triton GEMM (interpreted): the greedy tokens are
    transformers' on the same weights dequantized, as on the chunked path."""
    quantized, dequantized = suite._quantized_copy(random_model_dir("llama", **suite.MODEL), layout)
    calls = []

    def traced(x, weight, bias):
        calls.append(type(weight).__name__)
        return triton_quantized_linear(x, weight, bias)

    monkeypatch.setattr(linear, "quantized_linear", traced)  # the function projection() gives quantized weights
    prompts = random_prompts(3, 128, 1, 12)
    engine = LLMEngine.from_pretrained(str(quantized), EngineConfig(**suite.ENGINE_CONFIG))
    params = SamplingParams(max_new_tokens=4)
    outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    assert calls and set(calls) == {"Int4Weight" if suite is int4_tests else "QuantizedWeight"}
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == hf_greedy(dequantized, prompt, 4), f"prompt {i}"
