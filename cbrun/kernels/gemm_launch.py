"""What the three weight-dequantizing Triton GEMMs (``int4_gemm``, ``fp8_gemm``, ``mxfp4_gemm``) share: the
program's steps around the weight tile (``output_tile``, ``x_tile``, ``accumulate``, ``store_output_tile``, inlined
by Triton), their launch configuration and the launch (``launch_quantized_gemm``). Their wrappers' argument checks
are ``gemm_checks``; each format's weight tile is ``dequant_tiles``'.

Each kernel computes ``out = x @ dequantize(W).T (+ bias)`` for x (M, K) in fp16, bf16 or float32 and W (N, K)
stored quantized, on a grid of ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))`` programs, N fastest::

    program (pid_n, pid_m):  rows pid_m * BLOCK_M ..,  outputs pid_n * BLOCK_N ..
      for k0 in 0, BLOCK_K, ...:                              (one scale group / block per step)
          x tile (BLOCK_M, BLOCK_K)          <- x, x's dtype
          w tile (BLOCK_K, BLOCK_N)          <- packed codes + this step's scales, dequantized in registers:
                                                exact float32 value, rounded once to x's dtype
          acc (BLOCK_M, BLOCK_N) fp32       += tl.dot(x tile, w tile)
      out = acc (+ bias), rounded once to x's dtype

so each program reads its BLOCK_N rows of the quantized weight once per row tile, and a decode launch (one row
tile) reads the whole weight exactly once, in its stored bytes. The tile is ``tile_policy.pick_quantized_gemm_tile``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from cbrun.kernels.paged_attention import LaunchConfig, device_capability
from cbrun.kernels.tile_policy import pick_quantized_gemm_tile


@triton.jit
def output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output tile (the grid is N fastest): its rows (BLOCK_M,), output features (BLOCK_N,), and
    which of each exist."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output features
    return rows, cols, rows < M, cols < N


@triton.jit
def x_tile(x_rows, row_ok, k0, K, BLOCK_K: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) activations of the K step ``k0 ..`` (``x_rows``: (BLOCK_M, 1) row pointers), masked
    entries 0, in x's dtype."""
    ks = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    return tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def accumulate(acc, x, w, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """``acc + x @ w`` in float32 for the x tile (BLOCK_M, BLOCK_K) and the rounded weight tile (BLOCK_K,
    BLOCK_N); under the CPU interpreter the 16-bit operands are upcast first (exactly: its matmul)."""
    if DOT_IN_FP32:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    return acc + tl.dot(x, w, input_precision=DOT_PRECISION)


@triton.jit
def store_output_tile(out_ptr, acc, bias_ptr, rows, cols, row_ok, col_ok, stride_out_m, HAS_BIAS: tl.constexpr):
    """The epilogue: ``acc (+ bias)`` rounded once to out's dtype and stored at (rows, cols) of out (M, N)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_out_m + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


#: The longest K step; a layout whose scale groups are shorter caps it (``max_block_k``).
MAX_BLOCK_K = 128
#: The shortest K step ``tl.dot`` takes.
MIN_BLOCK_K = 16


def max_block_k(what: str, group: int, in_features: int) -> int:
    """The longest K step that keeps one scale group per step: ``MAX_BLOCK_K`` when one group spans all of K,
    else the largest power of two dividing ``group``, capped at ``MAX_BLOCK_K``.

    Args:
        what: the layout and its setting, for the error ("int4 group_size").
        group: input features per scale (group size, or the block's bi).
        in_features: K.

    Raises:
        ValueError: the group is not a multiple of 16 (and shorter than K): no ``tl.dot`` step fits in it; the
            CPU path of ``quantized_matmul`` still runs such a layout.
    """
    if group >= in_features:
        return MAX_BLOCK_K
    step = min(group & -group, MAX_BLOCK_K)
    if step < MIN_BLOCK_K:
        raise ValueError(
            f"{what} {group} is not a multiple of {MIN_BLOCK_K}: the Triton GEMM steps through K in whole scale "
            f"groups of at least {MIN_BLOCK_K}; run this layout on the CPU path (quantized_matmul on a CPU tensor)"
        )
    return step


@functools.lru_cache(maxsize=1024)
def gemm_launch_config(
    dtype: torch.dtype, rows: int, block_k_cap: int, capability: int, has_bias: bool, dot_in_fp32: bool = False
) -> LaunchConfig:
    """The constexprs, ``num_warps`` and ``num_stages`` of one quantized-GEMM launch (any of the three kernels).

    The wrappers launch with exactly this and ``cbrun.kernels.aot_fit`` compiles it for sm_80/89/90. Cached:
    every layer of a step asks the same question (callers must not change the returned dict).

    Args:
        dtype: the activations' dtype. rows: M. block_k_cap: ``max_block_k`` of the layout.
        capability: compute capability, major * 10 + minor. has_bias: the launch adds a bias.
        dot_in_fp32: upcast 16-bit dot operands exactly to float32 (the CPU interpreter only).
    """
    tile = pick_quantized_gemm_tile(capability, dtype.itemsize, max(rows, 1), block_k_cap)
    constexprs = dict(
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        HAS_BIAS=has_bias,
        DOT_PRECISION="ieee" if dtype == torch.float32 else None,
        DOT_IN_FP32=dot_in_fp32,
    )
    return LaunchConfig(constexprs, tile.num_warps, tile.num_stages)


def launch_config_for(x: torch.Tensor, block_k_cap: int, has_bias: bool) -> LaunchConfig:
    """``gemm_launch_config`` for the activations ``x`` (M, K) on their device."""
    interpreted = x.device.type == "cpu"
    return gemm_launch_config(x.dtype, x.shape[0], block_k_cap, device_capability(x.device), has_bias, interpreted)


def grid(config: LaunchConfig, rows: int, out_features: int) -> tuple[int, int]:
    """(N tiles, M tiles) of a launch: N fastest, so neighbouring programs share the activations' row tile."""
    c = config.constexprs
    return (-(-out_features // c["BLOCK_N"]), -(-rows // c["BLOCK_M"]))


def launch_quantized_gemm(
    kernel: Any,
    x: torch.Tensor,
    out: torch.Tensor,
    weight: tuple[torch.Tensor, ...],
    bias: torch.Tensor | None,
    layout: tuple[int, ...],
    weight_strides: tuple[int, ...],
    block_k_cap: int,
) -> torch.Tensor:
    """Launches one of the three kernels on arguments its wrapper checked (``gemm_checks``), in their common order:
    ``out, x, *weight, bias, M, N, K, *layout, out's and x's row strides, *weight_strides``, then the launch
    configuration's constexprs (``launch_config_for``).

    Args:
        kernel: the ``@triton.jit`` kernel. x: (M, K) activations. out: (M, N) output buffer.
        weight: the weight's tensors, as the kernel's pointers. bias: (N,) or None.
        layout: the format's integers after K (block sizes, group size). weight_strides: the weight tensors'
            strides the kernel takes. block_k_cap: ``max_block_k`` of the layout.

    Returns:
        ``out``; an empty product launches nothing.
    """
    rows, out_features = out.shape
    if rows == 0 or out_features == 0:
        return out
    config = launch_config_for(x, block_k_cap, bias is not None)
    tensors = (out, x, *weight, bias if bias is not None else x)  # any bias pointer without a bias: never read
    sizes = (rows, out_features, x.shape[1], *layout)
    config.launch(
        kernel, grid(config, rows, out_features), *tensors, *sizes, out.stride(0), x.stride(0), *weight_strides
    )
    return out
