"""Triton batch-invariant matmul: ``x @ weight.T (+ bias)`` whose every output row is the same bits whatever the
number of rows M and the row's place among them.

cuBLAS (``F.linear``) picks its kernel, tile and split-K by the problem's shape, M included, so a row's sums run
in another order in a batch of 3 than in a batch of 64. This kernel fixes all of it: one tile config per dtype
(``cbrun.kernels.tile_policy.pick_invariant_matmul_tile``, never chosen by M), no split-K, and each output's K loop
from 0 to K in ``BLOCK_K`` steps in one order, accumulated in float32 (Thinking Machines, "Defeating
Nondeterminism in LLM Inference", 2025; vLLM's ``VLLM_BATCH_INVARIANT`` matmul and SGLang's deterministic mode do
the same, with a persistent grid; this one is a plain grid, one program per output tile, which changes which
program computes a tile but never how)::

    program pid -> (pid_m, pid_n) in GROUP_M-row bands (L2 reuse of the weight tiles)
    acc(BLOCK_M, BLOCK_N) fp32 = 0
    for k in 0, BLOCK_K, 2 * BLOCK_K, ... < K:          (the same steps for every M)
        acc += x[rows, k : k + BLOCK_K] @ weight[cols, k : k + BLOCK_K].T
    out[rows, cols] = (acc + bias[cols]).to(out dtype)

M is not specialised by Triton (``do_not_specialize``): M = 1, or M divisible by 16, compiles the same binary as
any other M, so no row count gets other code.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cbrun.kernels.gemm_launch import store_output_tile
from cbrun.kernels.tile_policy import LaunchConfig, pick_invariant_matmul_tile

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid``: consecutive programs walk a band of ``GROUP_M`` row tiles, then
    the band's next column tile, so that the programs in flight share weight tiles in the L2 cache."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * num_pid_n)
    first_m = band * GROUP_M
    band_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % band_rows
    pid_n = (pid % (GROUP_M * num_pid_n)) // band_rows
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M"])
def batch_invariant_matmul_kernel(
    out_ptr,  # (M, N), strides (stride_out_m, 1)
    x_ptr,  # (M, K), strides (stride_x_m, 1)
    weight_ptr,  # (N, K), strides (stride_weight_n, 1): an nn.Linear weight, out = x @ weight.T
    bias_ptr,  # (N,) contiguous; read only if HAS_BIAS
    M,  # rows: never specialised (a row's code must not depend on it)
    N,
    K,
    stride_x_m,
    stride_weight_n,
    stride_out_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # row tiles per band of the program order
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding), else None (the default)
    DOT_IN_FP32: tl.constexpr,  # upcast bf16 dot operands (exactly): the CPU interpreter multiplies raw bf16 bits
):
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    ks = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x_m + ks[None, :]  # (BLOCK_M, BLOCK_K)
    w_ptrs = weight_ptr + cols.to(tl.int64)[None, :] * stride_weight_n + ks[:, None]  # (BLOCK_K, BLOCK_N)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = ks < K - k_step * BLOCK_K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    store_output_tile(out_ptr, acc, bias_ptr, rows, cols, row_ok, col_ok, stride_out_m, HAS_BIAS)


def batch_invariant_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with each output row the same bits whatever the number of rows (Triton).

    Args:
        x: (M, K) fp16/bf16/fp32, last dim contiguous.
        weight: (N, K) in x's dtype, last dim contiguous (an ``nn.Linear`` weight).
        bias: (N,) in x's dtype, contiguous, or None.
        out: optional (M, N) output in x's dtype, last dim contiguous.

    Returns:
        (M, N) in ``x.dtype`` (``out`` when given): float32 sums of K products, in ``BLOCK_K`` steps in order, plus
        the bias, rounded once. Not the same bits as ``F.linear`` (cuBLAS sums in another order).

    Raises:
        ValueError: naming the argument whose shape, dtype, stride or device is wrong.
    """
    _check_matmul_args(x, weight, bias, out)
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    if out is None:
        out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return out
    if in_features == 0:
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    launch = matmul_launch_config(x.dtype, bias is not None, x.is_cpu and x.dtype == torch.bfloat16)
    c = launch.constexprs
    grid = (triton.cdiv(num_rows, c["BLOCK_M"]) * triton.cdiv(out_features, c["BLOCK_N"]),)
    tensors = (out, x, weight, bias if bias is not None else weight)  # any bias pointer without a bias: never read
    strides = (x.stride(0), weight.stride(0), out.stride(0))
    launch.launch(batch_invariant_matmul_kernel, grid, *tensors, num_rows, out_features, in_features, *strides)
    return out


@functools.lru_cache(maxsize=64)
def matmul_launch_config(dtype: torch.dtype, has_bias: bool, dot_in_fp32: bool = False) -> LaunchConfig:
    """The constexprs, ``num_warps`` and ``num_stages`` of every ``batch_invariant_matmul_kernel`` launch in
    ``dtype``: the same on every part and for every shape (``cbrun.kernels.aot_fit`` compiles exactly this).

    Args:
        dtype: the activations' and weight's dtype. has_bias: whether a bias is added.
        dot_in_fp32: upcast bf16 dot operands (the CPU interpreter only); the tile stays the bf16 one.
    """
    tile = pick_invariant_matmul_tile(dtype.itemsize)
    constexprs = dict(
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m,
        HAS_BIAS=has_bias,
        DOT_PRECISION="ieee" if dtype == torch.float32 else None,
        DOT_IN_FP32=dot_in_fp32,
    )
    return LaunchConfig(constexprs, tile.num_warps, tile.num_stages)


def _check_matmul_args(x, weight, bias, out) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be (M, K) and weight (N, K), got shapes {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[1]} input features, x has {x.shape[1]}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}")
    named = (("weight", weight), ("bias", bias), ("out", out))
    for name, tensor in named:
        if tensor is not None and tensor.dtype != x.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from x dtype {x.dtype}")
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")
    if bias is not None and (bias.shape != (weight.shape[0],) or (bias.numel() > 1 and bias.stride(0) != 1)):
        raise ValueError(
            f"bias must be a contiguous ({weight.shape[0]},) tensor, got shape {tuple(bias.shape)} "
            f"strides {bias.stride()}"
        )
    if out is not None and out.shape != (x.shape[0], weight.shape[0]):
        raise ValueError(f"out must be ({x.shape[0]}, {weight.shape[0]}), got {tuple(out.shape)}")
    for name, tensor in (("x", x), ("weight", weight), ("out", out)):
        if tensor is not None and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {tensor.stride()}")
