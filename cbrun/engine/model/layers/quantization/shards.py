"""A tensor-parallel rank's slice of a quantized linear, as its checkpoint stores it: which part of each stored
tensor holds the rank's rows or input features, and the boundary a slice must start on.

A rank holds output rows ``[start, stop)`` of a column-parallel weight (dim 0) or input features ``[start, stop)``
of a row-parallel one (dim 1) (``cbrun.engine.model.layers.parallel.ShardLayout.split``). A quantized layout keeps
several values under one scale (a 128 x 128 float8 block, a group of 128 int4 inputs) or packs eight 4-bit codes
or zero points into one int32, so a slice that starts inside a block, group or word has no stored scale or word of
its own: such a split is refused at load (``split_unit``), as vLLM refuses it ("not divisible by weight
quantization block_n"). A slice that starts on one is read as whole blocks, groups and words of each stored tensor
(``stored_slice``), and becomes the same weight type (``QuantizedWeight``, ``Int4Weight``) over the rank's shape,
so a GEMM written for the type runs it unchanged.

Where each layout's tensors hold a weight's (out_features, in_features) values (``schemes``, ``int4``)::

    fp8 block (bo, bi)   weight (out, in); weight_scale_inv (ceil(out / bo), ceil(in / bi))
    compressed float8    weight (out, in); weight_scale (out, 1) / (out,) per channel, (1,) per tensor
    pack-quantized       weight_packed (out, ceil(in / 8)); weight_scale (out, groups);
                         weight_zero_point (ceil(out / 8), groups); weight_shape [out, in]
    gptq                 qweight (in / 8, out); qzeros (groups, out / 8); scales (groups, out); g_idx (in,)
    awq                  qweight (in, out / 8); qzeros (groups, out / 8); scales (groups, out)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cbrun.engine.model.layers.quantization.schemes import QuantScheme

#: 4-bit codes (or zero points) per int32 word.
CODES_PER_WORD = 8
#: The two dimensions of a linear's weight, as a split names them.
DIM_NAMES = ("output rows", "input features")


@dataclass(frozen=True)
class SplitUnit:
    """What a rank's slice of a quantized weight's dimension must start on.

    Attributes:
        multiple: the slice's start must be a multiple of it.
        why: the stored unit that sets it, for the refusal ("a float8 scale per 128 x 128 block").
    """

    multiple: int
    why: str


def split_unit(scheme: QuantScheme, dim: int, shape: tuple[int, int]) -> SplitUnit:
    """The unit a slice of dimension ``dim`` (0: output rows, 1: input features) of a ``shape`` weight stored in
    ``scheme``'s layout must start on (1: anywhere)."""
    group = scheme.group_size or shape[1]
    if scheme.layout == "float8":
        if scheme.block is None:  # per channel or per tensor: the scale never straddles a split
            return SplitUnit(1, "")
        bo, bi = scheme.block
        return SplitUnit(scheme.block[dim], f"one scale per {bo} x {bi} block ({scheme.method} weight_block_size)")
    if dim == 0:  # the zero points (and AWQ's codes) are packed eight output rows to an int32
        if scheme.layout == "pack-quantized" and scheme.symmetric:
            return SplitUnit(1, "")
        packed = "4-bit codes and zero points" if scheme.layout == "awq" else "zero points"
        return SplitUnit(CODES_PER_WORD, f"eight {packed} per int32 along the output rows ({scheme.method})")
    if scheme.layout == "awq":  # qweight (in, out / 8): the inputs are not packed
        return SplitUnit(group, f"one scale and zero point per group of {group} inputs (awq group_size)")
    codes = f"eight 4-bit codes per int32 along the inputs ({scheme.method})"
    if scheme.group_size is None:
        return SplitUnit(CODES_PER_WORD, codes)
    return SplitUnit(math.lcm(group, CODES_PER_WORD), f"one scale per group of {group} inputs (group_size) and {codes}")


def stored_slice(
    scheme: QuantScheme, suffix: str, dim: int, start: int, stop: int, shape: tuple[int, int], stored: tuple[int, ...]
) -> tuple[int, int, int] | None:
    """Which part of the stored tensor ``suffix`` holds the slice ``[start, stop)`` of dimension ``dim`` of the
    weight.

    Args:
        scheme: the checkpoint's layout.
        suffix: the stored tensor's name after the linear's (``weight_scale_inv``, ``qweight``, ...).
        dim: 0 (output rows) or 1 (input features) of the (out_features, in_features) weight.
        start, stop: the slice; ``start`` a multiple of ``split_unit(scheme, dim, shape).multiple``.
        shape: the whole weight's (out_features, in_features).
        stored: the stored tensor's shape.

    Returns:
        ``(stored dim, first, end)``, or None where every rank reads the tensor whole.
    """
    group = scheme.group_size or shape[1]
    per_word, per_group = _cover(start, stop, CODES_PER_WORD), _cover(start, stop, group)
    if scheme.layout == "float8":
        if suffix == "weight":
            return dim, start, stop
        if scheme.block is not None:
            return (dim, *_cover(start, stop, scheme.block[dim]))
        per_channel = len(stored) >= 1 and stored[0] == shape[0] and shape[0] > 1
        return (0, start, stop) if dim == 0 and per_channel else None
    if scheme.layout == "pack-quantized":
        # weight_packed (out, in / 8), weight_scale (out, groups), weight_zero_point (out / 8, groups)
        if suffix == "weight_shape":
            return None
        if dim == 0:
            return (0, *per_word) if suffix == "weight_zero_point" else (0, start, stop)
        return (1, *per_word) if suffix == "weight_packed" else (1, *per_group)
    # gptq: qweight (in / 8, out), qzeros (groups, out / 8), scales (groups, out), g_idx (in,)
    # awq:  qweight (in, out / 8), qzeros (groups, out / 8), scales (groups, out)
    if dim == 0:
        if suffix == "g_idx":
            return None
        packed = suffix == "qzeros" or (suffix == "qweight" and scheme.layout == "awq")
        return (1, *per_word) if packed else (1, start, stop)
    if suffix == "qweight":
        return (0, *per_word) if scheme.layout == "gptq" else (0, start, stop)
    return (0, start, stop) if suffix == "g_idx" else (0, *per_group)


def _cover(start: int, stop: int, unit: int) -> tuple[int, int]:
    """The units ``[start // unit, ceil(stop / unit))`` that hold elements ``[start, stop)``."""
    return start // unit, -(-stop // unit)


def rebase(
    scheme: QuantScheme,
    name: str,
    suffix: str,
    tensor: torch.Tensor,
    dim: int,
    start: int,
    stop: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """A stored tensor's slice restated for the rank's weight where it names positions of the whole one:
    compressed-tensors' ``weight_shape`` becomes the rank's shape, GPTQ's ``g_idx`` counts the rank's groups from
    0. Every other tensor is returned as it is.

    Raises:
        RuntimeError: ``weight_shape`` does not state the whole weight's ``shape`` (named by ``name``).
    """
    if suffix == "weight_shape":
        if [int(v) for v in tensor.reshape(-1).tolist()] != list(shape):
            raise RuntimeError(f"tensor {name} is {tensor.tolist()}, but config.json implies {list(shape)}")
        local = list(shape)
        local[dim] = stop - start
        return torch.tensor(local, dtype=tensor.dtype)
    if suffix == "g_idx" and dim == 1:
        return tensor - start // (scheme.group_size or shape[1])
    return tensor
