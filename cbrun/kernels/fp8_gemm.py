"""Triton GEMM over a float8 e4m3 weight with block scales, dequantized in the inner loop (W8A16 / W8A32).

The weight is ``cbrun.engine.model.layers.quantization.fp8.QuantizedWeight``'s layout: float8_e4m3fn values (N, K) and one
float32 scale per (bo, bi) block, which covers the ``fp8`` checkpoints' 128 x 128 ``weight_scale_inv`` (Qwen3-FP8,
DeepSeek-V3), compressed-tensors' per-output-channel ``weight_scale`` (the block (1, K)) and a per-tensor scale
(the block (N, K)). The real weight is ``float32(q) * scale[n // bo, k // bi]``
(``quantized_reference.fp8_dequant_ref``), rounded once to the activations' dtype: the weight-only GEMM whose greedy
tokens equal transformers' on the dequantized weights. The W8A8 alternative (``torch._scaled_mm``, activations
quantized too) is ``cbrun.kernels.fp8_scaled_mm``, opt-in.

The values are read as bytes and decoded with integer arithmetic, no float8 type in the kernel, so the same code
runs on sm_80 (no float8 conversions there) and in the interpreter: an e4m3 byte's sign, exponent and mantissa
moved into an fp16's (``((b & 0x80) << 8) | ((b & 0x7F) << 7)``) make its value times 2^-8 exactly, subnormals
included (the trick of vLLM's FP8 Marlin); the codes 0x7F / 0xFF are NaN.
The dequantizing tile load is ``dequant_tiles.fp8_weight_tile``, shared with the fused MoE kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbrun.kernels.dequant_tiles import fp8_weight_tile
from cbrun.kernels.gemm_checks import check_activations, check_fp8_weight
from cbrun.kernels.gemm_launch import (
    accumulate,
    launch_quantized_gemm,
    max_block_k,
    output_tile,
    store_output_tile,
    x_tile,
)


@triton.jit
def fp8_gemm_kernel(
    out_ptr,  # (M, N) x's dtype, strides (stride_out_m, 1)
    x_ptr,  # (M, K) fp16/bf16/fp32, strides (stride_x_m, 1)
    w_ptr,  # (N, K) float8_e4m3fn read as uint8, strides (stride_w_n, 1)
    scale_ptr,  # (ceil(N / block_n), ceil(K / block_k)) fp32, strides (stride_scale_n, stride_scale_k)
    bias_ptr,  # (N,) x's dtype; read only if HAS_BIAS
    M,
    N,
    K,
    scale_block_n,  # bo: output rows per scale
    scale_block_k,  # bi: inputs per scale; a multiple of BLOCK_K, or >= K
    stride_out_m,
    stride_x_m,
    stride_w_n,
    stride_scale_n,
    stride_scale_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 activations (no TF32 rounding), else None
    DOT_IN_FP32: tl.constexpr,  # upcast 16-bit dot operands (exactly): the CPU interpreter's matmul
):
    rows, cols, row_ok, col_ok = output_tile(M, N, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_m  # (BLOCK_M, 1)
    w_rows = w_ptr + cols.to(tl.int64)[None, :] * stride_w_n  # (1, BLOCK_N)
    scale_rows = scale_ptr + (cols // scale_block_n).to(tl.int64) * stride_scale_n  # (BLOCK_N,)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_tile(x_rows, row_ok, k0, K, BLOCK_K)  # (BLOCK_M, BLOCK_K)
        w = fp8_weight_tile(w_rows, scale_rows, col_ok, k0, K, scale_block_k, stride_scale_k, BLOCK_K)
        w = w.to(x_ptr.dtype.element_ty)  # (BLOCK_K, BLOCK_N): one rounding, the reference's value
        acc = accumulate(acc, x, w, DOT_PRECISION, DOT_IN_FP32)
    store_output_tile(out_ptr, acc, bias_ptr, rows, cols, row_ok, col_ok, stride_out_m, HAS_BIAS)


def fp8_block_k_cap(block: tuple[int, int], in_features: int) -> int:
    """The longest K step of an FP8 launch (``gemm_launch.max_block_k``): one scale block per step."""
    return max_block_k("fp8 scale block bi", block[1], in_features)


def fp8_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a float8 e4m3 W (N, K) with one scale per (bo, bi) block, dequantized in the
    kernel's inner loop (weight-only: x stays in its dtype).

    Args:
        x: (M, K) fp16/bf16/fp32, last dim contiguous.
        qweight: (N, K) float8_e4m3fn, rows contiguous.
        scale: (ceil(N / bo), ceil(K / bi)) float32 (any strides: a per-tensor scale may be broadcast).
        block: (bo, bi): (128, 128) for block-quantized checkpoints, (1, K) per output channel, (N, K) per tensor.
            bi must be a multiple of 16 or at least K.
        bias: (N,) in x's dtype or None. out: (M, N) buffer in x's dtype or None.

    Returns:
        (M, N) in x's dtype: the reference ``F.linear(x, fp8_dequant_ref(...), bias)`` up to summation order.

    Raises:
        ValueError: naming the argument whose shape, dtype, stride or device is wrong, or a block the kernel
            cannot step through.
    """
    name = "fp8_matmul_triton"
    check_fp8_weight(name, qweight, scale, block)
    (out_features, in_features), bo, bi = qweight.shape, int(block[0]), int(block[1])
    out = check_activations(name, x, out_features, in_features, qweight.device, bias, out)
    weight = (qweight.view(torch.uint8), scale)
    strides = (qweight.stride(0), scale.stride(0), scale.stride(1))
    cap = fp8_block_k_cap((bo, bi), in_features)
    return launch_quantized_gemm(fp8_gemm_kernel, x, out, weight, bias, (bo, bi), strides, cap)
