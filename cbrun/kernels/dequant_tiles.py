"""The weight-dequantizing tile loads shared by every Triton GEMM that reads a quantized weight: the dense GEMMs
(``int4_gemm``, ``fp8_gemm``, ``mxfp4_gemm``) and the fused MoE kernel (``fused_moe``). One copy of each format's
arithmetic; the kernels inline them.

Each ``*_weight_tile`` loads the (BLOCK_K, BLOCK_N) tile of ``W.T`` for the inputs ``k0 .. k0 + BLOCK_K`` and the
caller's BLOCK_N output features, and returns it as the exact real value in float32 (masked entries 0); the caller
rounds it once to the activations' dtype, which is the value ``quantized_reference`` gives. The layouts are
``quantized_reference``'s (see its docstring):

- int4: ``float32(code - zero) * scale``, eight codes an int32 word along K, one (zero, scale) per group; the
  tile's BLOCK_K / 8 words of each row are loaded once and unpacked in registers.
- FP8 e4m3 with block scales: the bytes decoded with integer arithmetic (no float8 type, so sm_80 and the
  interpreter run it): sign, exponent and mantissa moved into an fp16's make the value times 2^-8 exactly,
  subnormals included (vLLM's FP8 Marlin trick); the codes 0x7F / 0xFF are NaN.
- MXFP4: twice an E2M1 value is an integer (``m`` for exponent bits 0, ``(2 + m) << (e - 1)`` otherwise) and the
  E8M0 scale becomes the float 2^(s - 128) built from its bits, so the product is ldexp's exact result.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int4_weight_tile(
    w_rows,  # (1, BLOCK_N) pointers: each output feature's row of packed int32 words
    zero_rows,  # (BLOCK_N,) pointers: each output feature's row of uint8 zero points
    scale_rows,  # (BLOCK_N,) pointers: each output feature's row of fp32 scales
    col_ok,  # (BLOCK_N,) the output feature exists
    k0,  # first input of the step; a step never crosses a group
    words_per_row,  # ceil(K / 8)
    group_size,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # code 8w + i of a row is bits 4i.. of its word w, so (words, nibble, column) reshaped row-major is (k, column)
    wk = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # (BLOCK_K / 8,)
    words = tl.load(w_rows + wk[:, None], mask=(wk < words_per_row)[:, None] & col_ok[None, :], other=0)
    codes = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF  # (BK / 8, 8, BN)
    codes = tl.reshape(codes, (BLOCK_K, BLOCK_N))  # (BLOCK_K, BLOCK_N) int32 0..15
    group = k0 // group_size
    zero = tl.load(zero_rows + group, mask=col_ok, other=0).to(tl.int32)  # (BLOCK_N,)
    scale = tl.load(scale_rows + group, mask=col_ok, other=0.0)  # (BLOCK_N,) fp32
    return (codes - zero[None, :]).to(tl.float32) * scale[None, :]  # exact float32(code - zero) * scale


@triton.jit
def fp8_weight_tile(
    w_rows,  # (1, BLOCK_N) pointers: each output feature's row of e4m3 bytes
    scale_rows,  # (BLOCK_N,) pointers: each output feature's row of fp32 block scales
    col_ok,  # (BLOCK_N,) the output feature exists
    k0,  # first input of the step; a step never crosses a scale block
    K,
    scale_block_k,  # inputs per scale (bi)
    stride_scale_k,
    BLOCK_K: tl.constexpr,
):
    ks = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    k_ok = ks < K
    b = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0).to(tl.int32)  # (BK, BN)
    half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    q = half.to(tl.float32) * 256.0  # exact: the e4m3 value
    q = tl.where((b & 0x7F) == 0x7F, float("nan"), q)
    scale = tl.load(scale_rows + (k0 // scale_block_k) * stride_scale_k, mask=col_ok, other=0.0)  # (BLOCK_N,)
    return q * scale[None, :]


@triton.jit
def mxfp4_weight_tile(
    b_rows,  # (1, BLOCK_N) pointers: each output feature's row of bytes (two E2M1 codes each, low nibble first)
    s_rows,  # (1, BLOCK_N) pointers: each output feature's row of E8M0 exponents
    col_ok,  # (BLOCK_N,) the output feature exists
    k0,
    K,  # a multiple of 32
    BLOCK_K: tl.constexpr,  # a multiple of 32
):
    ks = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    wk_ok = (ks < K)[:, None] & col_ok[None, :]  # (BLOCK_K, BLOCK_N)
    # NOTE: bytes and scales are gathered per value; the repeats hit L1, DRAM sees each byte once.
    byte = tl.load(b_rows + (ks // 2)[:, None], mask=wk_ok, other=0).to(tl.int32)  # (BLOCK_K, BLOCK_N)
    code = (byte >> ((ks % 2) * 4)[:, None]) & 0xF
    s = tl.load(s_rows + (ks // 32)[:, None], mask=wk_ok, other=127).to(tl.int32)  # (BLOCK_K, BLOCK_N)
    e = (code >> 1) & 3
    m = code & 1
    twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0)).to(tl.float32)  # 2 * |value|, exact
    twice = tl.where(code >= 8, -twice, twice)  # -0.0 for the code 8, as the table has
    pow2_bits = tl.where(s >= 2, (s - 1) << 23, 1 << (21 + tl.minimum(s, 1)))  # 2^(s - 128) as float32 bits
    return twice * pow2_bits.to(tl.float32, bitcast=True)
