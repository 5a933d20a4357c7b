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
from cbrun.kernels.gemm_checks import check_activations, check_weight_tensor
from cbrun.kernels.gemm_launch import grid, launch_config_for, max_block_k


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
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output features
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_m  # (BLOCK_M, 1)
    w_rows = w_ptr + cols.to(tl.int64)[None, :] * stride_w_n  # (1, BLOCK_N)
    scale_rows = scale_ptr + (cols // scale_block_n).to(tl.int64) * stride_scale_n  # (BLOCK_N,)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        w = fp8_weight_tile(w_rows, scale_rows, col_ok, k0, K, scale_block_k, stride_scale_k, BLOCK_K)
        w = w.to(x_ptr.dtype.element_ty)  # (BLOCK_K, BLOCK_N): one rounding, the reference's value
        if DOT_IN_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_out_m + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


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
    if qweight.dim() != 2:
        raise ValueError(f"{name}: qweight must be (N, K) float8_e4m3fn, got shape {tuple(qweight.shape)}")
    if len(block) != 2 or any(isinstance(b, bool) or int(b) < 1 for b in block):
        raise ValueError(f"{name}: block must be two positive ints (bo, bi), got {block!r}")
    out_features, in_features = qweight.shape
    bo, bi = int(block[0]), int(block[1])
    check_weight_tensor(name, "qweight", qweight, (out_features, in_features), torch.float8_e4m3fn)
    scale_shape = (-(-out_features // bo), -(-in_features // bi))
    if tuple(scale.shape) != scale_shape or scale.dtype != torch.float32:
        raise ValueError(
            f"{name}: scale must be float32 of shape {scale_shape} for block {(bo, bi)}, got {scale.dtype} "
            f"{tuple(scale.shape)}"
        )
    if scale.device != qweight.device:
        raise ValueError(f"{name}: scale is on {scale.device}, qweight on {qweight.device}")
    out = check_activations(name, x, out_features, in_features, qweight.device, bias, out)
    if x.shape[0] == 0 or out_features == 0:
        return out
    config = launch_config_for(x, fp8_block_k_cap((bo, bi), in_features), bias is not None)
    fp8_gemm_kernel[grid(config, x.shape[0], out_features)](
        out,
        x,
        qweight.view(torch.uint8),
        scale,
        bias if bias is not None else scale,  # any pointer without a bias: never read
        x.shape[0],
        out_features,
        in_features,
        bo,
        bi,
        out.stride(0),
        x.stride(0),
        qweight.stride(0),
        scale.stride(0),
        scale.stride(1),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **config.constexprs,
    )
    return out
