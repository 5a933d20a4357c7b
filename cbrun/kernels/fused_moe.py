"""Triton fused mixture-of-experts: the grouped expert GEMM over the (token, expert) pairs sorted by expert, with the
experts' weights dense or quantized (int4 group, FP8 block, MXFP4) and dequantized in the inner loop.

The dataflow of vLLM's and SGLang's ``fused_moe`` (pairs sorted by expert, one GEMM per expert group, the A rows
gathered by token, the output scattered back by pair), with group offsets held on the device: nothing is read back
to the host and every shape and the grid depend on ``S = T * k`` and the tile only, so a step stays capturable::

    pairs (token, slot) -> expert ids -> stable sort by expert          (S,)  sorted_pairs
    per expert: its rows [start, end) of the sorted pairs; its row tiles of BLOCK_M
    tile_map (3, num_tiles): each row tile's expert, first row, end row  (tiles past the last: empty, they exit)
       num_tiles = cdiv(S, BLOCK_M) + min(S, E)  >=  sum over experts of cdiv(rows, BLOCK_M)

    launch 1 (GATED):  h[r]   = act(x[pair_r // k] @ gate[e].T + b_gate[e],  x[pair_r // k] @ up[e].T + b_up[e])
    launch 2:          y[pair_r] = (h[r] @ down[e].T + b_down[e]) * routing_weight[pair_r]
    then               out[t] = sum over the k slots of y[t, slot]        (transformers 5's order: weight, then sum)

Each launch's grid is ``(cdiv(N, BLOCK_N), num_tiles)``; program ``(n, m)`` reads its tile's expert and rows from
``tile_map`` and returns at once if the tile is empty. A gated program holds two accumulators (gate and up columns
``n * BLOCK_N ..``), so the activation runs in its epilogue: SiLU-and-multiply (Qwen3-MoE, Mixtral) or gpt-oss's
clamped SwiGLU ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``. Each
intermediate is rounded to the activations' dtype where the PyTorch path rounds it (the GEMM's output, the bias
sum, each elementwise op), so the results differ from ``fused_moe_reference`` by summation order only.

The weight formats read ``cbrun.kernels.dequant_tiles`` (the dense quantized GEMMs' copy of the arithmetic).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cbrun.kernels.dequant_tiles import fp8_weight_tile, int4_weight_tile, mxfp4_weight_tile
from cbrun.kernels.gemm_checks import ACTIVATION_DTYPES
from cbrun.kernels.gemm_launch import MAX_BLOCK_K, max_block_k
from cbrun.kernels.paged_attention import LaunchConfig, device_capability
from cbrun.kernels.quantized_matmul import Fp8Layout, Int4Layout, QuantizedLayout
from cbrun.kernels.quantized_reference import (
    MXFP4_BLOCK_SIZE,
    fp8_dequant_ref,
    int4_dequant_ref,
    mxfp4_dequant_ref,
)
from cbrun.kernels.tile_policy import pick_fused_moe_tile

#: The weight formats, in the kernel's ``WEIGHT_FORMAT`` numbering.
WEIGHT_FORMATS = ("dense", "int4", "fp8", "mxfp4")
#: The gated activations, in the kernel's ``ACTIVATION`` numbering.
ACTIVATIONS = ("silu", "swiglu_oai")
#: gpt-oss's clamped SwiGLU constants (``GptOssExperts``: ``alpha``, ``limit``).
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


@triton.jit
def _to(v, DTYPE: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """``v`` (fp32) in DTYPE, rounded to nearest even. NOTE: the CPU interpreter's own float32 -> bfloat16 cast
    truncates (a GPU's rounds to nearest even), so there (RNE_BY_BITS) the rounding is done on the bits first."""
    if RNE_BY_BITS and DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(DTYPE)


@triton.jit
def _round(v, DTYPE: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """``v`` (fp32) rounded to DTYPE and back: where the PyTorch path stores an intermediate in the model dtype."""
    return _to(v, DTYPE, RNE_BY_BITS).to(tl.float32)


@triton.jit
def _expert_rows(
    w_ptr, s_ptr, z_ptr, expert, cols, scale_block_n, stride_w_e, stride_w_n, stride_s_e, stride_s_n,
    WEIGHT_FORMAT: tl.constexpr,
):  # fmt: skip
    """Pointers to expert ``expert``'s rows for the outputs ``cols`` (BLOCK_N,): of its values (1, BLOCK_N), its
    scales ((BLOCK_N,); (1, BLOCK_N) for MXFP4) and its int4 zero points (BLOCK_N,), as ``_weight_tile`` takes them."""
    e = expert.to(tl.int64)
    n = cols.to(tl.int64)
    w_rows = w_ptr + e * stride_w_e + n[None, :] * stride_w_n
    z_rows = z_ptr + e * stride_s_e + n * stride_s_n
    if WEIGHT_FORMAT == 2:  # FP8: one scale row per scale_block_n outputs
        s_rows = s_ptr + e * stride_s_e + (cols // scale_block_n).to(tl.int64) * stride_s_n
    elif WEIGHT_FORMAT == 3:
        s_rows = s_ptr + e * stride_s_e + n[None, :] * stride_s_n
    else:
        s_rows = s_ptr + e * stride_s_e + n * stride_s_n
    return w_rows, s_rows, z_rows


@triton.jit
def _weight_tile(
    w_rows, s_rows, z_rows, col_ok, k0, K, words_per_row, group_k, stride_s_k,
    WEIGHT_FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """The (BLOCK_K, BLOCK_N) tile of an expert's ``W.T`` for the inputs ``k0 ..``, in DTYPE (float32 when
    INTERPRETED): dense as stored, quantized as the exact value rounded once (the reference's value)."""
    if WEIGHT_FORMAT == 0:
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[:, None], mask=(ks < K)[:, None] & col_ok[None, :], other=0.0)
    elif WEIGHT_FORMAT == 1:
        w = _to(int4_weight_tile(w_rows, z_rows, s_rows, col_ok, k0, words_per_row, group_k, BLOCK_K, BLOCK_N),
                DTYPE, INTERPRETED)  # fmt: skip
    elif WEIGHT_FORMAT == 2:
        w = _to(fp8_weight_tile(w_rows, s_rows, col_ok, k0, K, group_k, stride_s_k, BLOCK_K), DTYPE, INTERPRETED)
    else:
        w = _to(mxfp4_weight_tile(w_rows, s_rows, col_ok, k0, K, BLOCK_K), DTYPE, INTERPRETED)
    if INTERPRETED:
        w = w.to(tl.float32)
    return w


@triton.jit
def _activation(gate, up, alpha, limit, ACTIVATION: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """The gated activation of two (BLOCK_M, BLOCK_N) fp32 tiles holding DTYPE values, one rounding per op as the
    PyTorch path: ``F.silu(gate) * up``, or transformers' ``GptOssExperts._apply_gate``."""
    if ACTIVATION == 0:
        return _round(_round(gate * tl.sigmoid(gate), DTYPE, INTERPRETED) * up, DTYPE, INTERPRETED)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    sig = _round(tl.sigmoid(_round(gate * alpha, DTYPE, INTERPRETED)), DTYPE, INTERPRETED)
    glu = _round(gate * sig, DTYPE, INTERPRETED)
    return _round(_round(up + 1.0, DTYPE, INTERPRETED) * glu, DTYPE, INTERPRETED)


@triton.jit
def _output(acc, bias_ptr, bias_row, col_ok, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """A GEMM's (BLOCK_M, BLOCK_N) accumulator as the PyTorch path holds it: rounded to DTYPE, then the bias added
    (``bias_row``: (BLOCK_N,) offsets of the expert's bias row) and rounded again; fp32 tile of DTYPE values."""
    value = _round(acc, DTYPE, INTERPRETED)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + bias_row, mask=col_ok, other=0.0).to(tl.float32)
        value = _round(value + bias[None, :], DTYPE, INTERPRETED)
    return value


@triton.jit
def _expert_gemm(
    a_ptrs, row_ok, K, w_rows, s_rows, z_rows, w2_rows, s2_rows, z2_rows, col_ok, words_per_row, group_k, stride_s_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WEIGHT_FORMAT: tl.constexpr,
    GATED: tl.constexpr, DOT_PRECISION: tl.constexpr, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """The program's (BLOCK_M, BLOCK_N) fp32 accumulators over K: A rows (``a_ptrs``, (BLOCK_M, 1)) times the
    expert's first weight, and (GATED) its second; the second is zeros otherwise."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        a = tl.load(a_ptrs + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)  # (BM, BK)
        if INTERPRETED:
            a = a.to(tl.float32)
        w = _weight_tile(w_rows, s_rows, z_rows, col_ok, k0, K, words_per_row, group_k, stride_s_k,
                         WEIGHT_FORMAT, BLOCK_K, BLOCK_N, DTYPE, INTERPRETED)  # fmt: skip
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if GATED:
            w2 = _weight_tile(w2_rows, s2_rows, z2_rows, col_ok, k0, K, words_per_row, group_k, stride_s_k,
                              WEIGHT_FORMAT, BLOCK_K, BLOCK_N, DTYPE, INTERPRETED)  # fmt: skip
            acc2 += tl.dot(a, w2, input_precision=DOT_PRECISION)
    return acc, acc2


@triton.jit
def _epilogue(
    acc, acc2, bias_ptr, bias2_ptr, bias_row, col_ok, alpha, limit,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """The launch's (BLOCK_M, BLOCK_N) result before the routing weights: the GEMM's output (+ bias), or for a
    gated launch the activation of gate's and up's (fp32 holding DTYPE values)."""
    value = _output(acc, bias_ptr, bias_row, col_ok, HAS_BIAS, DTYPE, INTERPRETED)
    if GATED:
        up = _output(acc2, bias2_ptr, bias_row, col_ok, HAS_BIAS, DTYPE, INTERPRETED)
        value = _activation(value, up, alpha, limit, ACTIVATION, DTYPE, INTERPRETED)
    return value


@triton.jit
def _store(
    out_ptr, routing_ptr, value, rows, row_ok, pairs, cols, col_ok, stride_out_m,
    APPLY_ROUTING: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Stores ``value`` at its sorted rows, or (APPLY_ROUTING) times each pair's routing weight at the pair's row,
    rounded once to the output's dtype (the routing weights' dtype there, as torch's product)."""
    out_rows = rows
    if APPLY_ROUTING:
        value = value * tl.load(routing_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        out_rows = pairs
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * stride_out_m + cols[None, :]
    tl.store(out_ptrs, _to(value, out_ptr.dtype.element_ty, INTERPRETED), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def fused_moe_kernel(
    out_ptr,  # GATED: (S, N) x's dtype, sorted rows; else (S, N) the routing weights' dtype, by pair; (stride_out_m, 1)
    a_ptr,  # GATHER_A: (T, K) x, row pair // top_k; else (S, K) the sorted rows; x's dtype, (stride_a_m, 1)
    sorted_pairs_ptr,  # (S,) int32: each sorted row's pair, token * top_k + slot
    tile_map_ptr,  # (3, num_tiles) int32, contiguous: each row tile's expert, first row, end row (end <= first: empty)
    routing_ptr,  # (S,) routing weights by pair, fp32 or x's dtype; read only if APPLY_ROUTING
    w_ptr, w2_ptr,  # gate's (or the one weight's) and up's (GATED) values: _expert_rows; (stride_w_e, stride_w_n, 1)
    s_ptr, s2_ptr,  # their scales (quantized formats), strides (stride_s_e, stride_s_n, stride_s_k)
    z_ptr, z2_ptr,  # their int4 zero points, the scales' strides
    bias_ptr, bias2_ptr,  # (E, N) x's dtype each, strides (stride_bias_e, stride_bias_n); read only if HAS_BIAS
    N, K, num_tiles, top_k,
    words_per_row, group_k, scale_block_n,  # int4 ceil(K / 8); int4 group / fp8 bi (BLOCK_K's multiple or >= K); fp8 bo
    stride_out_m, stride_a_m, stride_w_e, stride_w_n, stride_s_e, stride_s_n, stride_s_k, stride_bias_e, stride_bias_n,
    alpha, limit,  # swiglu_oai's sigmoid gain and clamp
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WEIGHT_FORMAT: tl.constexpr, ACTIVATION: tl.constexpr,  # 0 dense, 1 int4, 2 fp8, 3 mxfp4; 0 silu(gate) * up, 1 oai
    GATED: tl.constexpr, GATHER_A: tl.constexpr,  # two weights, the activation in the epilogue; A rows x's (pair // k)
    APPLY_ROUTING: tl.constexpr, HAS_BIAS: tl.constexpr,  # scale by the pair's routing weight, store by pair; biases
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 activations (no TF32 rounding), else None
    INTERPRETED: tl.constexpr,  # the CPU interpreter: 16-bit dot operands upcast (exactly), bf16 rounded by bits
):  # fmt: skip
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_map_ptr + pid_m)
    row_start, row_end = tl.load(tile_map_ptr + num_tiles + pid_m), tl.load(tile_map_ptr + 2 * num_tiles + pid_m)
    if row_start >= row_end:
        return
    DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    rows = row_start + tl.arange(0, BLOCK_M)  # (BLOCK_M,) sorted rows
    row_ok = rows < row_end
    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_ok, other=0)  # (BLOCK_M,)
    a_ptrs = a_ptr + (pairs // top_k if GATHER_A else rows).to(tl.int64)[:, None] * stride_a_m  # (BLOCK_M, 1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output features
    col_ok = cols < N
    w_rows, s_rows, z_rows = _expert_rows(w_ptr, s_ptr, z_ptr, expert, cols, scale_block_n, stride_w_e, stride_w_n,
                                          stride_s_e, stride_s_n, WEIGHT_FORMAT)  # fmt: skip
    w2_rows, s2_rows, z2_rows = _expert_rows(w2_ptr, s2_ptr, z2_ptr, expert, cols, scale_block_n, stride_w_e,
                                             stride_w_n, stride_s_e, stride_s_n, WEIGHT_FORMAT)  # fmt: skip
    acc, acc2 = _expert_gemm(a_ptrs, row_ok, K, w_rows, s_rows, z_rows, w2_rows, s2_rows, z2_rows, col_ok,
                             words_per_row, group_k, stride_s_k, BLOCK_M, BLOCK_N, BLOCK_K, WEIGHT_FORMAT, GATED,
                             DOT_PRECISION, DTYPE, INTERPRETED)  # fmt: skip
    bias_row = expert.to(tl.int64) * stride_bias_e + cols * stride_bias_n  # (BLOCK_N,)
    value = _epilogue(acc, acc2, bias_ptr, bias2_ptr, bias_row, col_ok, alpha, limit,
                      GATED, ACTIVATION, HAS_BIAS, DTYPE, INTERPRETED)  # fmt: skip
    _store(out_ptr, routing_ptr, value, rows, row_ok, pairs, cols, col_ok, stride_out_m, APPLY_ROUTING, INTERPRETED)


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of all E experts (each N outputs by K inputs), as ``fused_moe_triton`` reads it.

    Attributes:
        format: one of ``WEIGHT_FORMATS``.
        data: dense (E, N, K) in the activations' dtype; int4 (E, N, ceil(K / 8)) int32 (code ``8w + i`` in bits
            ``4i``); fp8 (E, N, K) float8_e4m3fn; mxfp4 (E, N, K / 2) uint8 (or the checkpoint's (E, N, K / 32,
            16)). Any strides with the last dim contiguous: gpt-oss's interleaved gate columns are ``[:, 0::2]``.
        scales: int4 (E, N, groups) float32; fp8 (E, ceil(N / bo), ceil(K / bi)) float32; mxfp4 (E, N, K / 32)
            uint8 E8M0; None for dense.
        zeros: int4 (E, N, groups) uint8 zero points with the scales' strides; else None.
        in_features: K.
        block: int4 (1, group_size); fp8 (bo, bi); dense and mxfp4 ignore it.

    Raises:
        ValueError: a tensor's shape, dtype, stride or device is not the format's.
    """

    format: str
    data: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    in_features: int = 0
    block: tuple[int, int] = (1, 1)

    def __post_init__(self) -> None:
        if self.format not in WEIGHT_FORMATS:
            raise ValueError(f"ExpertWeights: format must be one of {WEIGHT_FORMATS}, got {self.format!r}")
        if self.format == "mxfp4" and self.data.dim() == 4:
            object.__setattr__(self, "data", self.data.flatten(2))
        if self.in_features == 0:
            k = self.data.shape[-1] * (2 if self.format == "mxfp4" else 1)
            object.__setattr__(self, "in_features", k)
        e, n, k = self.num_experts, self.out_features, self.in_features
        expected = {
            "dense": ((e, n, k), None, ()),
            "int4": ((e, n, -(-k // 8)), torch.int32, (e, n, -(-k // self.block[1]))),
            "fp8": ((e, n, k), torch.float8_e4m3fn, (e, -(-n // self.block[0]), -(-k // self.block[1]))),
            "mxfp4": ((e, n, k // 2), torch.uint8, (e, n, k // MXFP4_BLOCK_SIZE)),
        }[self.format]
        _check(self.format, "data", self.data, expected[0], expected[1])
        if self.format == "dense":
            if self.data.dtype not in ACTIVATION_DTYPES:
                raise ValueError(f"ExpertWeights: dense data must be one of {ACTIVATION_DTYPES}, got {self.data.dtype}")
            return
        scale_dtype = torch.uint8 if self.format == "mxfp4" else torch.float32
        assert self.scales is not None, f"ExpertWeights: {self.format} needs scales"
        _check(self.format, "scales", self.scales, expected[2], scale_dtype, last_contiguous=self.format != "fp8")
        if self.format == "mxfp4" and k % MXFP4_BLOCK_SIZE:
            raise ValueError(f"ExpertWeights: mxfp4 K = {k} is not a multiple of {MXFP4_BLOCK_SIZE}")
        if self.format == "int4":
            assert self.zeros is not None, "ExpertWeights: int4 needs zero points"
            _check("int4", "zeros", self.zeros, expected[2], torch.uint8)
            if self.zeros.stride() != self.scales.stride():
                raise ValueError("ExpertWeights: int4 zeros and scales must have equal strides")
        for t in (self.scales, self.zeros):
            if t is not None and t.device != self.data.device:
                raise ValueError("ExpertWeights: its tensors are on several devices")

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    @property
    def out_features(self) -> int:
        return self.data.shape[1]

    @property
    def block_k_cap(self) -> int:
        """The longest K step that keeps one scale group per step (``gemm_launch.max_block_k``)."""
        if self.format == "int4":
            return max_block_k("int4 group_size", self.block[1], self.in_features)
        if self.format == "fp8":
            return max_block_k("fp8 scale block bi", self.block[1], self.in_features)
        return MAX_BLOCK_K

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors (as the kernel reads them once per launch on decode)."""
        views = [t for t in (self.data, self.scales, self.zeros) if t is not None]
        return sum(t.shape.numel() * t.element_size() for t in views)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """(E, N, K) the real weights in ``dtype`` (the PyTorch reference; the whole stack: tests only)."""
        k = self.in_features
        per_expert = []
        for e in range(self.num_experts):
            if self.format == "dense":
                per_expert.append(self.data[e].to(dtype))
            elif self.format == "int4":
                assert self.zeros is not None and self.scales is not None
                per_expert.append(
                    int4_dequant_ref(self.data[e], self.zeros[e], self.scales[e], k, self.block[1], dtype)
                )
            elif self.format == "fp8":
                assert self.scales is not None
                per_expert.append(fp8_dequant_ref(self.data[e], self.scales[e], self.block, dtype))
            else:
                assert self.scales is not None
                per_expert.append(mxfp4_dequant_ref(self.data[e], self.scales[e], dtype))
        return torch.stack(per_expert)

    def kernel_args(self, x: torch.Tensor) -> tuple:
        """(values, scales, zeros) pointers for the kernel (unused ones replaced by ``x``: never read)."""
        data = self.data.view(torch.uint8) if self.format == "fp8" else self.data
        return (data, x if self.scales is None else self.scales, x if self.zeros is None else self.zeros)


def expert_op_args(weights: ExpertWeights) -> list[torch.Tensor]:
    """``weights``' tensors as ``torch.ops.cbrun.fused_moe`` takes them: values, then scales, then zero points."""
    return [t for t in (weights.data, weights.scales, weights.zeros) if t is not None]


def expert_weights_from_op_args(
    fmt: str, tensors: list[torch.Tensor], in_features: int, block: tuple[int, int]
) -> ExpertWeights:
    """The inverse of ``expert_op_args`` (the op's arguments carry no dataclass)."""
    scales, zeros = (list(tensors[1:]) + [None, None])[:2]
    return ExpertWeights(fmt, tensors[0], scales, zeros, in_features, block)


#: Each quantized layout's tensors (``cbrun.kernels.quantized_matmul``) as ``ExpertWeights`` fields.
_LAYOUT_FIELDS = {
    "int4": {"packed": "data", "scales": "scales", "zeros": "zeros"},
    "fp8": {"qweight": "data", "scale": "scales"},
    "mxfp4": {"blocks": "data", "scales": "scales"},
}


def _layout_format(layout: QuantizedLayout) -> str:
    return "int4" if isinstance(layout, Int4Layout) else "fp8" if isinstance(layout, Fp8Layout) else "mxfp4"


def stack_layouts(layouts: list[QuantizedLayout]) -> ExpertWeights:
    """E experts' quantized weights of one projection (each an (N, K) layout of one format) stacked into one
    ``ExpertWeights``: a copy, one (E, ...) tensor per field.

    Raises:
        ValueError: the layouts differ in format, shape or block.
    """
    first, fmt = layouts[0], _layout_format(layouts[0])
    for layout in layouts:
        same_block = not isinstance(layout, Fp8Layout) or layout.block == getattr(first, "block", None)
        same_group = not isinstance(layout, Int4Layout) or layout.group_size == getattr(first, "group_size", None)
        if _layout_format(layout) != fmt or layout.shape != first.shape or not (same_block and same_group):
            raise ValueError(
                f"stack_layouts: the experts' weights differ in format, shape or block ({fmt} {first.shape})"
            )
    fields = {
        dst: torch.stack([getattr(layout, src) for layout in layouts]) for src, dst in _LAYOUT_FIELDS[fmt].items()
    }
    block = (
        (1, first.group_size)
        if isinstance(first, Int4Layout)
        else first.block
        if isinstance(first, Fp8Layout)
        else (1, MXFP4_BLOCK_SIZE)
    )
    return ExpertWeights(fmt, fields["data"], fields["scales"], fields.get("zeros"), first.shape[1], block)


def layout_views(stack: ExpertWeights, layout: QuantizedLayout, expert: int) -> dict[int, torch.Tensor]:
    """``id`` of each of ``layout``'s tensors -> the same values in ``stack`` (expert ``expert``'s slice, in the
    tensor's shape): a stacked layer's per-expert weights can be rebound to views, its bytes held once."""
    views = {}
    for src, dst in _LAYOUT_FIELDS[stack.format].items():
        tensor = getattr(layout, src)
        views[id(tensor)] = getattr(stack, dst)[expert].view(tensor.shape)
    return views


def _check(fmt: str, name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None, last_contiguous=True):
    if tuple(t.shape) != tuple(shape) or (dtype is not None and t.dtype != dtype):
        raise ValueError(
            f"ExpertWeights: {fmt} {name} must be {dtype} of shape {tuple(shape)}, got {t.dtype} {tuple(t.shape)}"
        )
    if last_contiguous and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"ExpertWeights: {fmt} {name} must be contiguous in its last dim, got strides {t.stride()}")


@functools.lru_cache(maxsize=1024)
def fused_moe_launch_config(
    dtype: torch.dtype,
    pairs: int,
    num_experts: int,
    block_k_cap: int,
    capability: int | None,
    weight_format: str,
    gated: bool,
    activation: str,
    has_bias: bool,
    apply_routing: bool,
    interpreted: bool = False,
) -> LaunchConfig:
    """The constexprs, ``num_warps`` and ``num_stages`` of one ``fused_moe_kernel`` launch.

    ``fused_moe_triton`` launches with exactly this and ``cbrun.kernels.aot_fit`` compiles it for sm_80/89/90.
    The tile is ``tile_policy.pick_fused_moe_tile`` (BLOCK_M depends on ``pairs`` and ``num_experts`` only, so the
    gated and the down launch of one step share their row tiles). Cached: every layer asks the same question.

    Args:
        dtype: the activations' dtype. pairs: S = T * k. num_experts: E. block_k_cap: ``ExpertWeights.block_k_cap``.
        capability: major * 10 + minor. weight_format: one of ``WEIGHT_FORMATS``. gated: the gate/up launch.
        activation: one of ``ACTIVATIONS`` (gated launches). has_bias: expert biases. apply_routing: the down
        launch (routing weights, output by pair). interpreted: the CPU interpreter.
    """
    tile = pick_fused_moe_tile(capability, dtype.itemsize, pairs, num_experts, block_k_cap, gated)
    constexprs = dict(
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        WEIGHT_FORMAT=WEIGHT_FORMATS.index(weight_format),
        GATED=gated,
        ACTIVATION=ACTIVATIONS.index(activation) if gated else 0,
        GATHER_A=gated,
        APPLY_ROUTING=apply_routing,
        HAS_BIAS=has_bias,
        DOT_PRECISION="ieee" if dtype == torch.float32 else None,
        INTERPRETED=interpreted,
    )
    return LaunchConfig(constexprs, tile.num_warps, tile.num_stages)


def num_row_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Row tiles of a launch: enough for any routing of ``pairs`` pairs over ``num_experts`` experts (each
    non-empty expert wastes less than one tile)."""
    return -(-pairs // block_m) + min(pairs, num_experts)


def expert_tile_map(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert and each row tile's (expert, first row, end row), on the device, no host read.

    Args:
        expert_ids: (T, k) int64 each pair's expert.
        num_experts: E. block_m: the launches' BLOCK_M.

    Returns:
        ``(sorted_pairs, tile_map)``: (S,) int32 pair ids in a stable sort by expert, and (3, num_tiles) int32
        (``num_row_tiles``; unused tiles have end row 0 <= first row).
    """
    flat = expert_ids.reshape(-1)
    pairs = flat.shape[0]
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)
    tile = torch.arange(num_row_tiles(pairs, num_experts, block_m), device=flat.device)
    expert = torch.searchsorted(tile_ends, tile, right=True)  # E for the tiles past the last expert's
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    first = ends[e] - counts[e] + (tile - (tile_ends[e] - tiles[e])) * block_m
    tile_map = torch.stack((e, torch.where(used, first, 0), torch.where(used, ends[e], 0)))
    return order.to(torch.int32), tile_map.to(torch.int32).contiguous()


def fused_moe_triton(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate: ExpertWeights,
    up: ExpertWeights,
    down: ExpertWeights,
    activation: str = "silu",
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    alpha: float = SWIGLU_OAI_ALPHA,
    limit: float = SWIGLU_OAI_LIMIT,
) -> torch.Tensor:
    """The experts of a MoE block for routed tokens: two ``fused_moe_kernel`` launches and the sum over slots.

    Args:
        x: (T, hidden) fp16/bf16/fp32, last dim contiguous.
        routing_weights: (T, k) float32 or x's dtype: the product with each expert's output is in this dtype.
        expert_ids: (T, k) int64 in [0, E).
        gate, up: (E, I, hidden) each, one format with equal strides (views of one stacked tensor are fine); down:
            (E, hidden, I), any format.
        activation: ``"silu"`` (silu(gate) * up) or ``"swiglu_oai"`` (gpt-oss's, with ``alpha`` and ``limit``).
        gate_bias, up_bias: (E, I) in x's dtype with equal strides, or None (both or neither); down_bias: (E, hidden).

    Returns:
        (T, hidden) in x's dtype: ``fused_moe_reference`` up to summation order.

    Raises:
        ValueError: naming the argument whose shape, dtype, stride or device is wrong."""
    _check_routing(x, routing_weights, expert_ids, activation)
    _check_experts(x, gate, up, down, (gate_bias, up_bias, down_bias))
    (num_tokens, hidden), top_k, num_experts, width = x.shape, expert_ids.shape[1], gate.num_experts, gate.out_features
    if (pairs := num_tokens * top_k) == 0:
        return torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    interpreted, capability = x.device.type == "cpu", device_capability(x.device)
    gated, plain = (
        fused_moe_launch_config(x.dtype, pairs, num_experts, w.block_k_cap, capability, w.format, is_gated, activation,
                                bias is not None, not is_gated, interpreted)
        for w, is_gated, bias in ((gate, True, gate_bias), (down, False, down_bias))
    )  # fmt: skip
    assert gated.constexprs["BLOCK_M"] == plain.constexprs["BLOCK_M"], "both launches share the row tiles"
    sorted_pairs, tile_map = expert_tile_map(expert_ids, num_experts, gated.constexprs["BLOCK_M"])
    hidden_states = _empty((pairs, width), x.dtype, x.device)  # the gated launch's (S, I), sorted rows
    products = _empty((pairs, hidden), routing_weights.dtype, x.device)  # the down launch's, by pair
    rows = (sorted_pairs, tile_map, routing_weights.reshape(-1).contiguous(), top_k)
    _launch(hidden_states, x, (gate, up), (gate_bias, up_bias), gated, rows, alpha, limit)
    _launch(products, hidden_states, (down, down), (down_bias, down_bias), plain, rows, alpha, limit)
    return products.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)  # transformers 5's order, one rounding


def _check_routing(x: torch.Tensor, routing_weights: torch.Tensor, expert_ids: torch.Tensor, activation: str) -> None:
    """``fused_moe_triton``'s activations, routing and activation function, or a ValueError naming the bad one."""
    name = "fused_moe_triton"
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES or (x.shape[0] and x.stride(1) != 1):
        raise ValueError(
            f"{name}: x must be (T, hidden) fp16/bf16/fp32, last dim contiguous; got {x.dtype} {tuple(x.shape)}"
        )
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0] or expert_ids.dtype != torch.int64:
        raise ValueError(f"{name}: expert_ids must be (T, k) int64, got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    if routing_weights.shape != expert_ids.shape or routing_weights.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"{name}: routing_weights must be (T, k) float32 or {x.dtype}, got {routing_weights.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check_experts(
    x: torch.Tensor,
    gate: ExpertWeights,
    up: ExpertWeights,
    down: ExpertWeights,
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """``fused_moe_triton``'s expert weights and biases against x, or a ValueError naming the bad one."""
    name, hidden = "fused_moe_triton", x.shape[1]
    num_experts, width = gate.num_experts, gate.out_features
    if (up.format, up.data.shape, up.data.stride()) != (gate.format, gate.data.shape, gate.data.stride()):
        raise ValueError(f"{name}: gate and up must share one format, shape and strides")
    down_shape = (down.num_experts, down.out_features, down.in_features)
    if gate.in_features != hidden or down_shape != (num_experts, hidden, width):
        raise ValueError(
            f"{name}: gate/up must be (E, I, {hidden}) and down (E, {hidden}, I); got gate {tuple(gate.data.shape)}, "
            f"down {down_shape}"
        )
    for w in (gate, up, down):
        if w.data.device != x.device or (w.format == "dense" and w.data.dtype != x.dtype):
            raise ValueError(
                f"{name}: dense experts must be {x.dtype} on {x.device}, got {w.data.dtype} on {w.data.device}"
            )
    gate_bias, up_bias, down_bias = biases
    if (gate_bias is None) != (up_bias is None):
        raise ValueError(f"{name}: give gate_bias and up_bias both or neither")
    for bias, shape in zip(biases, ((num_experts, width), (num_experts, width), (num_experts, hidden))):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype != x.dtype or bias.device != x.device):
            raise ValueError(f"{name}: a bias must be {x.dtype} of shape {shape}, got {bias.dtype} {tuple(bias.shape)}")
    if gate_bias is not None and up_bias is not None and gate_bias.stride() != up_bias.stride():
        raise ValueError(f"{name}: gate_bias and up_bias must have equal strides")


def _launch(
    result: torch.Tensor,
    a: torch.Tensor,
    weights: tuple[ExpertWeights, ExpertWeights],
    biases: tuple[torch.Tensor | None, torch.Tensor | None],
    config: LaunchConfig,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    alpha: float,
    limit: float,
) -> None:
    """One ``fused_moe_kernel`` launch writing ``result`` from ``a`` over ``weights`` (the second one read only by a
    gated launch) and ``biases``; ``rows``: (sorted pairs, tile map, routing weights by pair, top_k)."""
    (w, w2), (bias, bias2) = weights, biases
    sorted_pairs, tile_map, routing, top_k = rows
    data, scales, zeros = w.kernel_args(a)
    data2, scales2, zeros2 = w2.kernel_args(a)
    bias_strides = (0, 0) if bias is None else bias.stride()
    scale_strides = (0, 0, 0) if w.scales is None else w.scales.stride()
    grid = (triton.cdiv(w.out_features, config.constexprs["BLOCK_N"]), tile_map.shape[1])
    fused_moe_kernel[grid](
        result, a, sorted_pairs, tile_map, routing,
        data, data2, scales, scales2, zeros, zeros2,
        a if bias is None else bias, a if bias2 is None else bias2,
        w.out_features, w.in_features, tile_map.shape[1], top_k,
        -(-w.in_features // 8), w.block[1], w.block[0],
        result.stride(0), a.stride(0), w.data.stride(0), w.data.stride(1),
        *scale_strides, *bias_strides, float(alpha), float(limit),
        num_warps=config.num_warps, num_stages=config.num_stages, **config.constexprs,
    )  # fmt: skip


def _empty(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A launch's intermediate buffer, every row of which the kernel writes (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def fused_moe_reference(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    activation: str = "silu",
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    alpha: float = SWIGLU_OAI_ALPHA,
    limit: float = SWIGLU_OAI_LIMIT,
) -> torch.Tensor:
    """``fused_moe_triton`` by its definition, on dense weights (``ExpertWeights.dequantize`` for quantized ones):
    each pair's expert in a loop over the pairs, intermediates in x's dtype.

    Args:
        gate, up: (E, I, hidden); down: (E, hidden, I), in x's dtype. The rest as ``fused_moe_triton``.

    Returns:
        (T, hidden) in x's dtype.
    """
    num_tokens, top_k = expert_ids.shape
    products = []
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(expert_ids[t, j])
            g, u = F.linear(x[t], gate[e]), F.linear(x[t], up[e])
            if gate_bias is not None and up_bias is not None:
                g, u = g + gate_bias[e], u + up_bias[e]
            if activation == "silu":
                h = F.silu(g) * u
            else:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                h = (u + 1) * (g * torch.sigmoid(g * alpha))
            y = F.linear(h, down[e])
            if down_bias is not None:
                y = y + down_bias[e]
            products.append(y * routing_weights[t, j])
    return torch.stack(products).view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
