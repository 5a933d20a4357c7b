"""PyTorch references of the quantized-weight GEMMs: dequantize the weight, then one dense matmul.

Each Triton GEMM (``int4_gemm``, ``fp8_gemm``, ``mxfp4_gemm``) and the CPU path of ``quantized_matmul`` are tested
against these. Every dequantized value is computed exactly in float32 and rounded once to the activations' dtype,
which is what the kernels do in their inner loop, so the GEMMs differ from the reference only in summation order.

Layouts (a weight of ``out_features`` N by ``in_features`` K, the output feature first, as ``F.linear`` takes it):

- int4 group (``cbrun.engine.model.layers.quantization.int4.Int4Weight``'s layout): ``packed`` int32 (N, ceil(K / 8)), code ``8w + i``
  of a row in bits ``4i .. 4i + 3`` of its word ``w`` (unsigned 0..15); ``zeros`` uint8 (N, groups);
  ``scales`` float32 (N, groups), groups = ceil(K / group_size). Real weight ``float32(code - zero) * scale``.
- FP8 block (``QuantizedWeight``): ``qweight`` float8_e4m3fn (N, K); ``scale`` float32 (ceil(N / bo),
  ceil(K / bi)) for the block (bo, bi): (128, 128) for the ``fp8`` checkpoints, (1, K) per output channel, (N, K)
  per tensor. Real weight ``float32(q) * scale[n // bo, k // bi]``.
- MXFP4 (OCP Microscaling, gpt-oss's experts): ``blocks`` uint8 (N, K / 32, 16) as the checkpoint stores each
  expert's ``*_blocks`` (or flattened (N, K / 2)), byte ``j`` of a row holding value ``2j`` in its low nibble and
  ``2j + 1`` in its high one, each an FP4 E2M1 code (sign bit 3, two exponent bits, one mantissa bit:
  ``FP4_E2M1_VALUES``); ``scales`` uint8 (N, K / 32), E8M0 exponents with bias 127, one per 32 values along K.
  Real weight ``ldexp(FP4_E2M1_VALUES[code], scale - 127)``, transformers'
  ``integrations/mxfp4.convert_moe_packed_tensors`` (which then transposes each expert to (K, N) for gpt-oss's
  ``x @ W``; here the weight stays (N, K)). The E8M0 code 255 (NaN in the OCP spec) is taken as 2^128, as that
  function does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The 16 FP4 E2M1 values by code (OCP Microscaling Formats v1.0, table 5; transformers' ``FP4_VALUES``).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Values per E8M0 scale along K in MXFP4.
MXFP4_BLOCK_SIZE = 32
#: The E8M0 exponent bias.
E8M0_BIAS = 127


def int4_dequant_ref(
    packed: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    in_features: int,
    group_size: int,
    dtype: torch.dtype,
    start: int = 0,
    stop: int | None = None,
) -> torch.Tensor:
    """Output rows ``[start, stop)`` of the real int4 weight, (rows, in_features) in ``dtype``:
    ``float32(code - zero) * scale`` rounded once.

    Args:
        packed: (N, ceil(in_features / 8)) int32. zeros: (N, groups) uint8 0..15. scales: (N, groups) float32.
        in_features: K. group_size: input features per (zero, scale).
        dtype: the result's dtype. start, stop: the rows (default all).
    """
    packed, zeros, scales = packed[start:stop], zeros[start:stop], scales[start:stop]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    codes = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)[:, :in_features]
    group = torch.arange(in_features, device=packed.device) // group_size
    values = (codes - zeros[:, group].to(torch.int32)).to(torch.float32) * scales[:, group].to(torch.float32)
    return values.to(dtype)


def fp8_dequant_ref(
    qweight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    start: int = 0,
    stop: int | None = None,
) -> torch.Tensor:
    """Output rows ``[start, stop)`` of the real float8 weight, (rows, K) in ``dtype``:
    ``float32(q) * scale[n // bo, k // bi]`` rounded once.

    Args:
        qweight: (N, K) float8_e4m3fn. scale: (ceil(N / bo), ceil(K / bi)) float32. block: (bo, bi).
        dtype: the result's dtype. start, stop: the rows (default all).
    """
    bo, bi = block
    stop = qweight.shape[0] if stop is None else stop
    rows = torch.arange(start, stop, device=scale.device) // bo
    cols = torch.arange(qweight.shape[1], device=scale.device) // bi
    return (qweight[start:stop].to(torch.float32) * scale.to(torch.float32)[rows][:, cols]).to(dtype)


def mxfp4_blocks_2d(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks`` as (N, K / 2) bytes: the checkpoint's (N, K / 32, 16) flattened (a view), or as given."""
    if blocks.dim() == 3:
        if blocks.shape[2] != MXFP4_BLOCK_SIZE // 2:
            raise ValueError(f"MXFP4 blocks must be (N, K / 32, 16) or (N, K / 2), got {tuple(blocks.shape)}")
        return blocks.reshape(blocks.shape[0], -1)
    if blocks.dim() != 2:
        raise ValueError(f"MXFP4 blocks must be (N, K / 32, 16) or (N, K / 2), got {tuple(blocks.shape)}")
    return blocks


def mxfp4_dequant_ref(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, start: int = 0, stop: int | None = None
) -> torch.Tensor:
    """Output rows ``[start, stop)`` of the real MXFP4 weight, (rows, K) in ``dtype``:
    ``ldexp(FP4_E2M1_VALUES[code], scale - 127)`` rounded once.

    Args:
        blocks: (N, K / 32, 16) or (N, K / 2) uint8, two E2M1 codes a byte, the low nibble first.
        scales: (N, K / 32) uint8 E8M0 exponents.
        dtype: the result's dtype. start, stop: the rows (default all).
    """
    data, scales = mxfp4_blocks_2d(blocks)[start:stop], scales[start:stop]
    rows = data.shape[0]
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(rows, -1).long()  # (N, K), low nibble first
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=data.device)
    exponents = scales.to(torch.int32) - E8M0_BIAS
    exponents = exponents.repeat_interleave(MXFP4_BLOCK_SIZE, dim=1)  # (N, K)
    # NOTE: torch.ldexp in float32 is exact here (the smallest result, 0.5 * 2^-127, is a float32 subnormal).
    return torch.ldexp(lut[codes], exponents).to(dtype)


def dequantized_matmul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the real weight in ``x.dtype``: the oracle of every quantized GEMM.

    Args:
        x: (M, K) fp16/bf16/fp32. weight: (N, K), the dequantized weight in ``x.dtype``. bias: (N,) or None.

    Returns:
        (M, N) in ``x.dtype``.
    """
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
