"""Triton GEMM over an MXFP4 weight (gpt-oss's experts), dequantized in the inner loop (W4A16 / W4A32).

The weight is the checkpoint's: ``*_blocks`` uint8 (N, K / 32, 16), two FP4 E2M1 codes a byte (value ``2j`` of a
row in the low nibble of its byte ``j``, ``2j + 1`` in the high one), and ``*_scales`` uint8 (N, K / 32), one E8M0
exponent per 32 values along K (OCP Microscaling v1.0). The real weight is ``ldexp(e2m1(code), scale - 127)``
(``quantized_reference.mxfp4_dequant_ref``, equal to transformers' ``convert_moe_packed_tensors``), rounded once
to the activations' dtype.

Decoding is integer arithmetic: twice an E2M1 value is an integer, ``m`` for exponent bits 0 and ``(2 + m) << (e -
1)`` otherwise, and the E8M0 scale becomes the float 2^(s - 128) built from its bits (normal for s >= 2, the two
subnormals below), so ``(2v) * 2^(s - 128)`` is ldexp's exact result, overflow included (the C kernel in
``cpu_dequant.c`` computes the same product).
The dequantizing tile load is ``dequant_tiles.mxfp4_weight_tile``, shared with the fused MoE kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbrun.kernels.dequant_tiles import mxfp4_weight_tile
from cbrun.kernels.gemm_checks import check_activations, check_mxfp4_weight
from cbrun.kernels.gemm_launch import accumulate, launch_quantized_gemm, output_tile, store_output_tile, x_tile


@triton.jit
def mxfp4_gemm_kernel(
    out_ptr,  # (M, N) x's dtype, strides (stride_out_m, 1)
    x_ptr,  # (M, K) fp16/bf16/fp32, strides (stride_x_m, 1)
    blocks_ptr,  # (N, K / 2) uint8, strides (stride_blocks_n, 1): value 2j low nibble of byte j, 2j + 1 high
    scales_ptr,  # (N, K / 32) uint8 E8M0 exponents (bias 127), strides (stride_scales_n, 1)
    bias_ptr,  # (N,) x's dtype; read only if HAS_BIAS
    M,
    N,
    K,  # a multiple of 32
    stride_out_m,
    stride_x_m,
    stride_blocks_n,
    stride_scales_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 activations (no TF32 rounding), else None
    DOT_IN_FP32: tl.constexpr,  # upcast 16-bit dot operands (exactly): the CPU interpreter's matmul
):
    rows, cols, row_ok, col_ok = output_tile(M, N, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_m  # (BLOCK_M, 1)
    b_rows = blocks_ptr + cols.to(tl.int64)[None, :] * stride_blocks_n  # (1, BLOCK_N)
    s_rows = scales_ptr + cols.to(tl.int64)[None, :] * stride_scales_n  # (1, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_tile(x_rows, row_ok, k0, K, BLOCK_K)  # (BLOCK_M, BLOCK_K)
        w = mxfp4_weight_tile(b_rows, s_rows, col_ok, k0, K, BLOCK_K).to(x_ptr.dtype.element_ty)  # one rounding
        acc = accumulate(acc, x, w, DOT_PRECISION, DOT_IN_FP32)
    store_output_tile(out_ptr, acc, bias_ptr, rows, cols, row_ok, col_ok, stride_out_m, HAS_BIAS)


#: The longest K step of an MXFP4 launch: any multiple of 32 keeps whole scale blocks per step.
MXFP4_BLOCK_K_CAP = 128


def mxfp4_matmul_triton(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for an MXFP4 W (N, K), dequantized in the kernel's inner loop.

    Args:
        x: (M, K) fp16/bf16/fp32, last dim contiguous; K a multiple of 32.
        blocks: (N, K / 32, 16) uint8 as one expert's ``*_blocks`` in the checkpoint, or (N, K / 2); rows
            contiguous.
        scales: (N, K / 32) uint8 E8M0 exponents.
        bias: (N,) in x's dtype or None. out: (M, N) buffer in x's dtype or None.

    Returns:
        (M, N) in x's dtype: the reference ``F.linear(x, mxfp4_dequant_ref(...), bias)`` up to summation order.

    Raises:
        ValueError: naming the argument whose shape, dtype, stride or device is wrong (K not a multiple of 32
            included).
    """
    name = "mxfp4_matmul_triton"
    data = check_mxfp4_weight(name, blocks, scales, x.shape[-1])
    out = check_activations(name, x, data.shape[0], x.shape[-1], data.device, bias, out)
    strides = (data.stride(0), scales.stride(0))
    return launch_quantized_gemm(mxfp4_gemm_kernel, x, out, (data, scales), bias, (), strides, MXFP4_BLOCK_K_CAP)
