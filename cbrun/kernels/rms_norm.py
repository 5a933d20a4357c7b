"""Triton RMSNorm, one program per row: a row's sum of squares runs in one order whatever the number of rows.

torch's ``x.pow(2).mean(-1)`` on CUDA may split one row's sum over several blocks when there are few rows (its
reduction config follows the number of outputs), so a row's norm could change with its batch. Here each row is
one program that walks its columns in ``BLOCK`` steps from 0 (``cbrun.kernels.tile_policy.pick_row_tile``, chosen
by the row length only), keeping ``BLOCK`` float32 partial sums that are reduced once at the end::

    acc[BLOCK] = 0;  for c in 0, BLOCK, ...: acc += x[row, c : c + BLOCK] ** 2
    inv = rsqrt(sum(acc) / D + eps)
    out[row] = weight * (x[row] * inv).to(dtype)          (float32 in and out when dtype is float32)

The output follows the Llama family's order of operations (``LlamaRMSNorm``: normalise in float32, cast back,
then scale), so the elementwise part equals transformers' bit for bit; the sum of squares may differ from
torch's by float32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbrun.kernels.tile_policy import LaunchConfig, pick_row_tile

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def rms_norm_kernel(
    out_ptr,  # (R, D), strides (stride_out, 1)
    x_ptr,  # (R, D), strides (stride_x, 1)
    weight_ptr,  # (D,) contiguous, x's dtype
    eps,  # fp32
    D,  # columns per row
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,  # columns per loop step (a power of two)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < D, other=0.0).to(tl.float32)
        acc += x * x
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps)
    for start in range(0, D, BLOCK):
        ok = start + cols < D
        x = tl.load(x_row + start + cols, mask=ok, other=0.0)
        w = tl.load(weight_ptr + start + cols, mask=ok, other=0.0)
        normed = (x.to(tl.float32) * inv).to(x_ptr.dtype.element_ty)
        # A product of two 16-bit values is exact in float32, so rounding it once equals the 16-bit multiply.
        tl.store(
            out_row + start + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok
        )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim, each row in one order whatever the number of rows (Triton).

    Args:
        x: (..., D) fp16/bf16/fp32; its rows (all dims but the last, flattened) need not be contiguous with each
            other, but each row must be (last dim contiguous) and the leading dims must flatten to one stride.
        weight: (D,) in x's dtype, contiguous.
        eps: added to the mean square.
        out: optional output of x's shape and dtype (may be ``x`` itself).

    Returns:
        x's shape and dtype: ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, the mean in float32.

    Raises:
        ValueError: naming the argument whose shape, dtype, stride or device is wrong.
    """
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}")
    if x.dim() < 1 or weight.shape != (x.shape[-1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(
            f"weight must be a ({x.shape[-1] if x.dim() else '?'},) {x.dtype} tensor on {x.device}, got "
            f"{tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    if weight.numel() > 1 and weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous, got stride {weight.stride()}")
    rows = _as_rows(x, "x")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be a {tuple(x.shape)} {x.dtype} tensor on {x.device}, got {tuple(out.shape)}")
    out_rows = _as_rows(out, "out")
    if rows.shape[0] == 0 or rows.shape[1] == 0:
        return out
    launch = rms_norm_launch_config(rows.shape[1])
    args = (out_rows, rows, weight, float(eps), rows.shape[1], rows.stride(0), out_rows.stride(0))
    launch.launch(rms_norm_kernel, (rows.shape[0],), *args)
    return out


def rms_norm_launch_config(num_columns: int) -> LaunchConfig:
    """The launch of ``rms_norm_kernel`` for rows of ``num_columns``: by the row length only."""
    tile = pick_row_tile(num_columns)
    return LaunchConfig(dict(BLOCK=tile.block), tile.num_warps, 1)


def _as_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` viewed as (R, D) without a copy (a copy would hide the caller's output)."""
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {x.stride()}")
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError as exc:
        raise ValueError(f"{name}'s leading dims do not flatten to one stride (strides {x.stride()})") from exc
