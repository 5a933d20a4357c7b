"""Triton GEMM over an int4 group-quantized weight, dequantized in the inner loop (W4A16 / W4A32).

The weight is ``cbrun.engine.model.layers.quantization.int4.Int4Weight``'s layout, whatever checkpoint it came from (compressed-tensors
``pack-quantized``, GPTQ ``desc_act: false``, AWQ GEMM): 4-bit codes packed eight to an int32 along K, one uint8
zero point and one float32 scale per output row and group of ``group_size`` inputs; the real weight is
``float32(code - zero) * scale`` (``quantized_reference.int4_dequant_ref``). The loop and the tile are
``cbrun.kernels.gemm_launch``'s; per K step each program loads BLOCK_K / 8 words of each of its BLOCK_N rows once
and unpacks them in registers (a per-code gather of the words staged each word eight times in shared memory: 97 KiB
against 41 KiB for the large tile on sm_89), and one (zero, scale) pair per row (BLOCK_K never crosses a group).
The dequantizing tile load is ``dequant_tiles.int4_weight_tile``, shared with the fused MoE kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbrun.kernels.dequant_tiles import int4_weight_tile
from cbrun.kernels.gemm_checks import check_activations, check_int4_weight
from cbrun.kernels.gemm_launch import (
    accumulate,
    launch_quantized_gemm,
    max_block_k,
    output_tile,
    store_output_tile,
    x_tile,
)


@triton.jit
def int4_gemm_kernel(
    out_ptr,  # (M, N) x's dtype, strides (stride_out_m, 1)
    x_ptr,  # (M, K) fp16/bf16/fp32, strides (stride_x_m, 1)
    packed_ptr,  # (N, ceil(K / 8)) int32, strides (stride_packed_n, 1): code 8w + i in bits 4i..4i+3 of word w
    zeros_ptr,  # (N, groups) uint8 zero points 0..15, strides (stride_group_n, 1)
    scales_ptr,  # (N, groups) fp32, strides (stride_group_n, 1)
    bias_ptr,  # (N,) x's dtype; read only if HAS_BIAS
    M,
    N,
    K,
    words_per_row,  # ceil(K / 8)
    group_size,  # inputs per (zero, scale); a multiple of BLOCK_K, or >= K
    stride_out_m,
    stride_x_m,
    stride_packed_n,
    stride_group_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 activations (no TF32 rounding), else None
    DOT_IN_FP32: tl.constexpr,  # upcast 16-bit dot operands (exactly): the CPU interpreter's matmul
):
    rows, cols, row_ok, col_ok = output_tile(M, N, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_m  # (BLOCK_M, 1)
    w_rows = packed_ptr + cols.to(tl.int64)[None, :] * stride_packed_n  # (1, BLOCK_N)
    group_rows = cols.to(tl.int64) * stride_group_n  # (BLOCK_N,)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_tile(x_rows, row_ok, k0, K, BLOCK_K)  # (BLOCK_M, BLOCK_K)
        w = int4_weight_tile(
            w_rows,
            zeros_ptr + group_rows,
            scales_ptr + group_rows,
            col_ok,
            k0,
            words_per_row,
            group_size,
            BLOCK_K,
            BLOCK_N,
        ).to(x_ptr.dtype.element_ty)  # (BLOCK_K, BLOCK_N): the exact value rounded once, the reference's
        acc = accumulate(acc, x, w, DOT_PRECISION, DOT_IN_FP32)
    store_output_tile(out_ptr, acc, bias_ptr, rows, cols, row_ok, col_ok, stride_out_m, HAS_BIAS)


def int4_block_k_cap(group_size: int, in_features: int) -> int:
    """The longest K step of an int4 launch (``gemm_launch.max_block_k``): one group per step."""
    return max_block_k("int4 group_size", group_size, in_features)


def int4_matmul_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    in_features: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for an int4 group-quantized W (N, K), dequantized in the kernel's inner loop.

    Args:
        x: (M, K) fp16/bf16/fp32, last dim contiguous.
        packed: (N, ceil(K / 8)) int32, eight 4-bit codes a word (code ``8w + i`` in bits ``4i``).
        zeros: (N, groups) uint8 zero points. scales: (N, groups) float32, groups = ceil(K / group_size); both
            with the same strides.
        in_features: K, the weight's input width (the packing pads it to a multiple of 8); x must have it.
        group_size: inputs per group; a multiple of 16, or at least K (one group a row).
        bias: (N,) in x's dtype or None. out: (M, N) buffer in x's dtype or None.

    Returns:
        (M, N) in x's dtype: the reference ``F.linear(x, int4_dequant_ref(...), bias)`` up to summation order.

    Raises:
        ValueError: naming the argument whose shape, dtype, stride or device is wrong, or a group size the
            kernel cannot step through (not a multiple of 16 and shorter than K).
    """
    name = "int4_matmul_triton"
    check_int4_weight(name, packed, zeros, scales, in_features, group_size)
    if zeros.stride() != scales.stride():  # the kernel takes one stride for both
        raise ValueError(f"{name}: zeros and scales must have equal strides, got {zeros.stride()}, {scales.stride()}")
    out = check_activations(name, x, packed.shape[0], in_features, packed.device, bias, out)
    layout = (packed.shape[1], int(group_size))
    cap = int4_block_k_cap(group_size, in_features)
    weight = (packed, zeros, scales)
    return launch_quantized_gemm(
        int4_gemm_kernel, x, out, weight, bias, layout, (packed.stride(0), scales.stride(0)), cap
    )
