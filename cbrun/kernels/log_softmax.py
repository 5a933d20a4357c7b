"""Triton log-softmax, one program per row: a row's max and sum of exponentials run in one order whatever the
number of rows.

Each row walks its V columns in ``BLOCK`` steps from 0 (``cbrun.kernels.tile_policy.pick_row_tile``, chosen by V
only) with an online max and sum per lane, combined once at the end, then writes ``x - logsumexp(x)`` in a second
pass::

    m[BLOCK] = -inf, s[BLOCK] = 0
    for c in 0, BLOCK, ...:  m' = max(m, x_c);  s = s * exp(m - m') + exp(x_c - m');  m = m'
    lse = M + log(sum(s * exp(m - M))),  M = max(m)
    out[row] = x[row] - lse          (float32)

Used where a batch-invariant step needs log-probabilities on the GPU (vLLM's batch-invariant mode replaces
``log_softmax`` with a kernel of the same shape). A row of all -inf gives NaN, as ``torch.log_softmax`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbrun.kernels.tile_policy import LaunchConfig, pick_row_tile

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def log_softmax_kernel(
    out_ptr,  # (R, V) fp32, strides (stride_out, 1)
    x_ptr,  # (R, V) fp16/bf16/fp32, strides (stride_x, 1)
    V,  # columns per row
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,  # columns per loop step (a power of two)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane with nothing finite yet: no NaN
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    row_max = tl.max(m, axis=0)
    m_safe = tl.where(m == float("-inf"), row_max, m)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m_safe - row_max), axis=0))
    for start in range(0, V, BLOCK):
        ok = start + cols < V
        x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_row + start + cols, x - lse, mask=ok)


def log_softmax_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.log_softmax(x.float(), dim=-1)`` with each row reduced in one order whatever the number of rows.

    Args:
        x: (R, V) fp16/bf16/fp32 logits, last dim contiguous.
        out: optional (R, V) float32 output, last dim contiguous.

    Returns:
        (R, V) float32 log-probabilities (``out`` when given).

    Raises:
        ValueError: naming the argument whose shape, dtype, stride or device is wrong.
    """
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a 2-D tensor in one of {_FLOAT_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if out.shape != x.shape or out.dtype != torch.float32 or out.device != x.device:
        raise ValueError(
            f"out must be a {tuple(x.shape)} float32 tensor on {x.device}, got {out.dtype} {tuple(out.shape)}"
        )
    for name, tensor in (("x", x), ("out", out)):
        if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {tensor.stride()}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        return out
    launch = log_softmax_launch_config(x.shape[1])
    launch.launch(log_softmax_kernel, (x.shape[0],), out, x, x.shape[1], x.stride(0), out.stride(0))
    return out


def log_softmax_launch_config(num_columns: int) -> LaunchConfig:
    """The launch of ``log_softmax_kernel`` for rows of ``num_columns``: by the row length only."""
    tile = pick_row_tile(num_columns)
    return LaunchConfig(dict(BLOCK=tile.block), tile.num_warps, 1)
