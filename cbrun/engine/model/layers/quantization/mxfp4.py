"""MXFP4 MoE experts (``quant_method: "mxfp4"``: gpt-oss's checkpoints), kept quantized in memory and dequantized
by the MoE block a chunk of experts at a time (``cbrun.engine.model.layers.moe.SparseMoE``): the weight type and
its dequantization (the PyTorch reference).

The layout (OCP Microscaling Formats v1.0, MXFP4; transformers' ``integrations/mxfp4.py``): each expert projection
``{name}`` of a layer is two tensors,

- ``{name}_blocks``: uint8 (E, out, G, 16), G = in / 32: per output row, G blocks of 32 FP4 (e2m1) codes, two
  codes a byte, the low nibble first (input column ``32 g + 2 j`` is byte ``j``'s low nibble, ``32 g + 2 j + 1``
  its high nibble);
- ``{name}_scales``: uint8 (E, out, G): one e8m0 scale per block, the power of two ``2 ** (scale - 127)``.

A code ``c`` is the e2m1 value ``FP4_E2M1_VALUES[c]`` (sign bit 3, then 2 exponent bits and 1 mantissa bit:
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), so the real weight is
``FP4_E2M1_VALUES[code] * 2 ** (scale - 127)``, exact in float32 and in bfloat16 for the scales real checkpoints hold
(the products have two significant bits). gpt-oss stores ``gate_up_proj`` (E, 2 I, hidden) with gate and up
interleaved along ``out``, and ``down_proj`` (E, hidden, I); transformers dequantizes them to (E, in, out)
parameters, the layout ``Mxfp4Experts.dequantize`` writes too, so the grouped GEMM reads the same memory order.
The dequantization is ``cbrun.kernels``' (C on the CPU, the PyTorch reference elsewhere); on CUDA, where the
experts' grouped GEMM has no MXFP4 kernel yet, they are dequantized the same way a chunk at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbrun.engine.model.layers.quantization.base import ExpertStack
from cbrun.kernels import cpu_dequant
from cbrun.kernels.quantized_reference import E8M0_BIAS, FP4_E2M1_VALUES, MXFP4_BLOCK_SIZE, mxfp4_dequant_ref

#: Values per scale, and packed bytes per block.
BLOCK = MXFP4_BLOCK_SIZE
BLOCK_BYTES = BLOCK // 2


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The real values of MXFP4 blocks of any leading shape, in float32 (exact): the C kernel
    (``cbrun.kernels.cpu_dequant.mxfp4_dequant``) where it builds, else the PyTorch reference
    (``cbrun.kernels.quantized_reference.mxfp4_dequant_ref``), the same bits.

    Args:
        blocks: (..., G, 16) uint8, two e2m1 codes a byte, the low nibble first.
        scales: (..., G) uint8 e8m0 exponents.

    Returns:
        (..., G * 32) float32.
    """
    *lead, groups, _ = blocks.shape
    flat_blocks, flat_scales = blocks.reshape(-1, groups * BLOCK_BYTES), scales.reshape(-1, groups)
    rows = flat_blocks.shape[0]
    real = cpu_dequant.mxfp4_dequant(flat_blocks, flat_scales, 0, rows)
    if real is None:
        real = mxfp4_dequant_ref(flat_blocks, flat_scales, torch.float32)
    return real.reshape(*lead, groups * BLOCK)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks and scales of a float weight (round to the nearest e2m1 value, ties to the lower magnitude,
    after dividing each block by its power-of-two scale ``2 ** (floor(log2(absmax)) - 2)``, so the block's largest
    value maps into [4, 8) and saturates at 6). For tests and benchmarks that build MXFP4 checkpoints; the
    dequantized result is what ``dequantize_mxfp4`` gives back.

    Args:
        weight: (..., in) with ``in`` a multiple of 32.

    Returns:
        (blocks (..., in / 32, 16) uint8, scales (..., in / 32) uint8).
    """
    grouped = weight.float().unflatten(-1, (-1, BLOCK))  # (..., G, 32)
    absmax = grouped.abs().amax(-1).clamp(min=2.0**-100)
    exponent = (torch.floor(torch.log2(absmax)) - 2).clamp(-E8M0_BIAS, 127)
    scaled = grouped / torch.exp2(exponent)[..., None]
    lut = torch.tensor(FP4_E2M1_VALUES[:8], dtype=torch.float32, device=weight.device)
    codes = (scaled.abs()[..., None] - lut).abs().argmin(-1)  # nearest magnitude, the lower one on a tie
    codes = torch.where(scaled < 0, codes + 8, codes).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + E8M0_BIAS).to(torch.uint8)


@dataclass
class Mxfp4Experts(ExpertStack):
    """One projection of a MoE layer's experts kept as MXFP4 (``{name}_blocks`` and ``{name}_scales``).

    Attributes:
        blocks: (E, out, in / 32, 16) uint8.
        scales: (E, out, in / 32) uint8.
        dtype: the dtype the GEMM computes in (the engine's).
    """

    blocks: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        experts, out, groups, _ = self.blocks.shape
        return torch.Size((experts, out, groups * BLOCK))

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def tensors(self) -> list[torch.Tensor]:
        return [self.blocks, self.scales]

    def dequantize(self, experts: slice = slice(None)) -> torch.Tensor:
        """(E', out, in) the real weights of ``experts`` in ``dtype``, stored (E', in, out) (a transposed view:
        the grouped GEMM reads the (E', in, out) transpose contiguously, as transformers' dequantized
        parameters). One expert at a time, so the float32 transient is one expert's."""
        blocks, scales = self.blocks[experts], self.scales[experts]
        num, out_features, in_features = blocks.shape[0], self.shape[1], self.shape[2]
        real = torch.empty(num, in_features, out_features, dtype=self.dtype, device=self.device)
        for e in range(num):
            real[e].copy_(dequantize_mxfp4(blocks[e], scales[e]).T)
        return real.transpose(1, 2)


def mxfp4_experts(
    name: str, blocks: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int, int], dtype: torch.dtype
) -> Mxfp4Experts:
    """The stored ``{name}_blocks`` / ``{name}_scales`` as ``Mxfp4Experts``, checked against the (E, out, in)
    ``shape`` config.json implies.

    Raises:
        RuntimeError: naming the tensor, when a dtype or shape is not the MXFP4 layout's.
    """
    experts, out_features, in_features = shape
    if in_features % BLOCK:
        raise RuntimeError(f"{name}: {in_features} input features are not a multiple of the MXFP4 block of {BLOCK}")
    groups = in_features // BLOCK
    for suffix, tensor, want in (
        ("_blocks", blocks, (experts, out_features, groups, BLOCK_BYTES)),
        ("_scales", scales, (experts, out_features, groups)),
    ):
        if tensor.dtype != torch.uint8:
            raise RuntimeError(f"tensor {name}{suffix} is {tensor.dtype}, but MXFP4 stores uint8")
        if tuple(tensor.shape) != want:
            raise RuntimeError(
                f"tensor {name}{suffix} has shape {list(tensor.shape)}, but config.json implies {list(want)}"
            )
    return Mxfp4Experts(blocks, scales, dtype)
