"""int4 weight-only linears: the weight type that keeps them packed in memory, its PyTorch dequantization (the
reference the chunked GEMM calls), and the three checkpoint layouts read into it.

One layout in memory whatever the checkpoint (``Int4Weight``): the 4-bit codes of each output row packed eight to
an int32 along the input features (code ``8 * k + i`` in bits ``4 * i .. 4 * i + 3`` of word ``k``, unsigned
0..15), one zero point (uint8, 0..15) and one float32 scale per output row and group of ``group_size`` input
features. The real weight is ``(code - zero) * scale``. The checkpoints it is read from:

- compressed-tensors ``pack-quantized`` (llm-compressor's W4A16): ``weight_packed`` int32 (out, ceil(in / 8)) in
  exactly this packing, holding ``q + 8`` for the signed code q in [-8, 7]; ``weight_scale`` (out, groups);
  ``weight_shape`` [out, in]; an asymmetric scheme adds ``weight_zero_point`` int32 (ceil(out / 8), groups), the
  signed zero points plus 8 packed along the output rows (compressed-tensors' ``pack_to_int32``, packed_dim 0).
  Real weight ``(q - zero_point) * scale``: code ``q + 8``, zero ``zero_point + 8``.
- GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format: "gptq"``): ``qweight`` int32 (in / 8, out), packed along the
  *input* features in the same bit order; ``qzeros`` int32 (groups, out / 8), each stored as ``zero - 1`` (the
  v1 format's offset, which AutoGPTQ's kernels add back); ``scales`` (groups, out); ``g_idx`` (in,) each input
  feature's group. Real weight ``scales[g, j] * (q[i, j] - zero[g, j])`` with g = ``g_idx[i]``, transposed.
- AWQ (AutoAWQ's GEMM version): ``qweight`` int32 (in, out / 8) packed along the *output* features in the
  interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (bits ``4 * i`` hold output ``8 * k + order[i]``); ``qzeros``
  (groups, out / 8) packed the same way, no offset; ``scales`` (groups, out). Real weight ``(q - zero) * scale``.

GPTQ's ``qweight`` transposed is the common layout already (the same bit order along the inputs); AWQ's is
repacked at load, one tensor at a time (a transient of that tensor's codes), never the whole model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property

import torch

from cbrun.engine.model.layers.quantization.base import DEQUANT_CHUNK_ELEMENTS, QuantizedLinearWeight
from cbrun.kernels import cpu_dequant
from cbrun.kernels.quantized_matmul import Int4Layout

assert sys.byteorder == "little", "Int4Weight.dequantize reads int32 words as little-endian bytes"

#: Bit offsets of the eight 4-bit codes in an int32, code i at ``4 * i``.
_SHIFTS = tuple(range(0, 32, 4))
#: AWQ's packing order: bits ``4 * i`` of a word hold output column ``order[i]`` of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Int4Weight(QuantizedLinearWeight):
    """A linear layer's weight kept as 4-bit codes with a zero point and a scale per group of input features.

    The real weight is ``(code[i, j] - zeros[i, j // g]) * scales[i, j // g]`` for g = ``group_size``
    (``dequantize``).

    Attributes:
        packed: (out_features, ceil(in_features / 8)) int32, code ``8 * k + c`` of row i in bits ``4c..4c+3`` of
            ``packed[i, k]`` (unsigned).
        zeros: (out_features, groups) uint8 zero points, 0..15.
        scales: (out_features, groups) float32, groups = ceil(in_features / group_size).
        in_features: the weight's input width (the packing pads it to a multiple of 8).
        group_size: input features per scale.
        dtype: the dtype the GEMM computes in (the engine's).
    """

    packed: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    in_features: int
    group_size: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.in_features))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def storage_dtype(self) -> str:
        return "int4 (packed in int32)"

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.zeros, self.scales]

    @cached_property
    def kernel_layout(self) -> Int4Layout:
        """The same tensors as ``cbrun.kernels.quantized_matmul.Int4Layout`` (the Triton GEMM's input)."""
        return Int4Layout(self.packed, self.zeros, self.scales, self.in_features, self.group_size)

    def rows_per_chunk(self) -> int:
        """Output rows ``chunked_quantized_linear`` dequantizes at once: about ``DEQUANT_CHUNK_ELEMENTS`` elements."""
        return max(1, min(self.shape[0], DEQUANT_CHUNK_ELEMENTS // self.in_features))

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """``dequantize_reference``, in C on the CPU where it builds (``cbrun.kernels.cpu_dequant``: the same
        bits, one pass)."""
        stop = self.shape[0] if stop is None else stop
        fast = cpu_dequant.int4_dequant(
            self.packed, self.zeros, self.scales, self.in_features, self.group_size, start, stop
        )
        return self.dequantize_reference(start, stop) if fast is None else fast.to(self.dtype)

    def dequantize_reference(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Output rows ``[start, stop)`` of the real weight, (stop - start, in_features) in ``self.dtype``.

        Each value is ``float32(code - zero) * scale`` (exact integers times a float32, one rounding) cast once
        to ``self.dtype``: the PyTorch reference of the int4 GEMM.
        """
        stop = self.shape[0] if stop is None else stop
        rows, groups, g = stop - start, self.scales.shape[1], self.group_size
        codes = _unpack_bytes(self.packed[start:stop])  # (rows, 8 * words) uint8
        width = groups * g
        if codes.shape[1] != width:  # the last group ragged (or the packing's padding): whole groups, cut after
            codes = torch.nn.functional.pad(codes, (0, width - codes.shape[1])) if codes.shape[1] < width else codes
            codes = codes[:, :width]
        # NOTE: in place, one float32 pass each: (float(q) - float(z)) * s is float32(q - z) * s exactly.
        values = codes.reshape(rows, groups, g).to(torch.float32)
        values.sub_(self.zeros[start:stop].unsqueeze(-1)).mul_(self.scales[start:stop].unsqueeze(-1))
        return values.view(rows, width)[:, : self.in_features].to(self.dtype)


def _unpack_bytes(packed: torch.Tensor) -> torch.Tensor:
    """``unpack_rows`` on uint8 (a quarter of the bytes moved): byte b of a little-endian int32 word holds code
    2b in its low nibble and 2b + 1 in its high one (``sys.byteorder`` is checked at import)."""
    data = packed.contiguous().view(torch.uint8)  # (rows, 4 * words)
    return torch.stack((data & 0xF, data >> 4), dim=-1).view(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """(rows, words) int32 of eight 4-bit codes each -> (rows, 8 * words) int32 codes 0..15, code ``8k + i`` from
    bits ``4i`` of word k (compressed-tensors' and GPTQ's bit order)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """(rows, n) integer codes 0..15 -> (rows, ceil(n / 8)) int32, the inverse of ``unpack_rows`` (zero-padded)."""
    rows, n = codes.shape
    words = -(-n // 8)
    padded = torch.zeros(rows, words * 8, dtype=torch.int32, device=codes.device)
    padded[:, :n] = codes
    padded = padded.view(rows, words, 8)
    packed = torch.zeros(rows, words, dtype=torch.int32, device=codes.device)
    for i, shift in enumerate(_SHIFTS):  # code 7's high bit lands in the sign bit: int32 shifts wrap
        packed |= padded[:, :, i] << shift
    return packed


def row_major(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in memory of its own with row-major strides. NOTE: ``contiguous()`` is not enough: it keeps a
    size-1 dimension's stride as it was (a transposed (1, N) tensor stays stride (1, N) as (N, 1)), and a kernel
    that compares the zeros' and scales' strides reads that as another layout (one group per row: a channel-wise
    checkpoint, or a tensor-parallel rank's slice of one group)."""
    if tensor.is_contiguous() and tensor.stride() == torch.empty(tensor.shape, device="meta").stride():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _group_count(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = torch.int32) -> None:
    if tuple(tensor.shape) != shape:
        raise RuntimeError(f"tensor {name} has shape {list(tensor.shape)}, but its layout implies {list(shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise RuntimeError(f"tensor {name} is {tensor.dtype}, but its layout stores {dtype}")


def from_compressed_tensors(
    name: str,
    shape: tuple[int, int],
    tensors: dict[str, torch.Tensor],
    group_size: int | None,
    symmetric: bool,
    dtype: torch.dtype,
) -> Int4Weight:
    """A compressed-tensors ``pack-quantized`` 4-bit weight (see the module docstring).

    Args:
        name: the linear's weight name (``...q_proj.weight``), for errors.
        shape: (out_features, in_features) the config implies.
        tensors: the linear's ``weight_packed``, ``weight_scale``, ``weight_shape`` and, when not symmetric,
            ``weight_zero_point``, by those suffixes.
        group_size: input features per scale; None: one group per row (the ``channel`` strategy).
        symmetric: the scheme's ``symmetric`` (zero point 0 as a signed value).
        dtype: the engine's dtype.

    Raises:
        RuntimeError: a tensor's shape or dtype is not the layout's.
    """
    out_features, in_features = shape
    group_size = group_size or in_features
    groups = _group_count(in_features, group_size)
    base = name[: -len("weight")]
    stated = tensors["weight_shape"]
    if [int(v) for v in stated.reshape(-1).tolist()] != [out_features, in_features]:
        raise RuntimeError(f"tensor {base}weight_shape is {stated.tolist()}, but config.json implies {list(shape)}")
    packed = tensors["weight_packed"]
    _check(base + "weight_packed", packed, (out_features, -(-in_features // 8)))
    scales = tensors["weight_scale"]
    _check(base + "weight_scale", scales, (out_features, groups), None)
    if symmetric:
        zeros = torch.full((out_features, groups), 8, dtype=torch.uint8, device=packed.device)
    else:
        zero_point = tensors["weight_zero_point"]
        _check(base + "weight_zero_point", zero_point, (-(-out_features // 8), groups))
        zeros = unpack_rows(zero_point.T.contiguous()).T[:out_features].to(torch.uint8)  # packed along rows
    return Int4Weight(
        row_major(packed), row_major(zeros), row_major(scales.to(torch.float32)), in_features, group_size, dtype
    )


def from_gptq(
    name: str,
    shape: tuple[int, int],
    tensors: dict[str, torch.Tensor],
    group_size: int | None,
    dtype: torch.dtype,
) -> Int4Weight:
    """A GPTQ (v1 checkpoint format, ``desc_act: false``) 4-bit weight, repacked (see the module docstring).

    Args:
        name: the linear's weight name, for errors.
        shape: (out_features, in_features) the config implies.
        tensors: the linear's ``qweight``, ``qzeros``, ``scales`` and ``g_idx`` (optional), by those suffixes.
        group_size: input features per group; None: one group (GPTQ's ``group_size: -1``).
        dtype: the engine's dtype.

    Raises:
        RuntimeError: a tensor's shape or dtype is not the layout's, or ``g_idx`` is not the contiguous groups
            of ``desc_act: false`` (an act-order checkpoint whose config does not say so).
    """
    out_features, in_features = shape
    group_size = group_size or in_features
    groups = _group_count(in_features, group_size)
    base = name[: -len("weight")]
    if in_features % 8 or out_features % 8:
        raise RuntimeError(f"GPTQ weight {name} of shape {list(shape)}: both dimensions must be multiples of 8")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    _check(base + "qweight", qweight, (in_features // 8, out_features))
    _check(base + "qzeros", qzeros, (groups, out_features // 8))
    _check(base + "scales", scales, (groups, out_features), None)
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        contiguous = torch.arange(in_features, device=g_idx.device) // group_size
        if tuple(g_idx.shape) != (in_features,) or not torch.equal(g_idx.to(torch.int64), contiguous):
            raise RuntimeError(
                f"tensor {base}g_idx is not the contiguous groups of desc_act false (an act-order checkpoint); "
                "cbrun runs GPTQ with desc_act false only"
            )
    # Word (k, j) of qweight holds inputs 8k..8k+7 of output j in the common bit order: its transpose is the
    # common layout as it is, no codes unpacked.
    packed = row_major(qweight.T)
    zeros = (unpack_rows(qzeros) + 1) & 0xF  # (groups, out): the v1 format stores zero - 1
    return Int4Weight(
        packed,
        row_major(zeros.T.to(torch.uint8)),
        row_major(scales.T.to(torch.float32)),
        in_features,
        group_size,
        dtype,
    )


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """(rows, n / 8) int32 in AWQ's interleaved order -> (rows, n) int32 codes in column order."""
    codes = unpack_rows(packed).view(packed.shape[0], -1, 8)  # nibble i holds column AWQ_ORDER[i]
    inverse = [AWQ_ORDER.index(c) for c in range(8)]
    return codes[:, :, inverse].reshape(packed.shape[0], -1)


def from_awq(
    name: str, shape: tuple[int, int], tensors: dict[str, torch.Tensor], group_size: int, dtype: torch.dtype
) -> Int4Weight:
    """An AWQ (GEMM version, zero point) 4-bit weight, repacked (see the module docstring).

    Args:
        name: the linear's weight name, for errors.
        shape: (out_features, in_features) the config implies.
        tensors: the linear's ``qweight``, ``qzeros`` and ``scales``, by those suffixes.
        group_size: input features per group.
        dtype: the engine's dtype.

    Raises:
        RuntimeError: a tensor's shape or dtype is not the layout's.
    """
    out_features, in_features = shape
    groups = _group_count(in_features, group_size)
    base = name[: -len("weight")]
    if out_features % 8:
        raise RuntimeError(f"AWQ weight {name} of shape {list(shape)}: out_features must be a multiple of 8")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    _check(base + "qweight", qweight, (in_features, out_features // 8))
    _check(base + "qzeros", qzeros, (groups, out_features // 8))
    _check(base + "scales", scales, (groups, out_features), None)
    packed = pack_rows(awq_unpack(qweight).T)  # (out, in) codes, packed along the inputs
    zeros = row_major(awq_unpack(qzeros).T.to(torch.uint8))
    return Int4Weight(packed, zeros, row_major(scales.T.to(torch.float32)), in_features, group_size, dtype)
