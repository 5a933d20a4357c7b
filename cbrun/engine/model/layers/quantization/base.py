"""What every quantized weight format shares: the weight type a linear keeps quantized in memory, its GEMM (on CUDA
the Triton kernel that dequantizes in its inner loop, ``cbrun.kernels.quantized_matmul``; elsewhere the chunked
dequantize-then-``F.linear``), and a MoE layer's quantized experts.

The formats: ``cbrun.engine.model.layers.quantization.fp8`` (float8 with block scales) and
``cbrun.engine.model.layers.quantization.int4`` (4-bit codes with group scales); which checkpoint layouts are read
into them is ``cbrun.engine.model.layers.quantization.schemes``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from cbrun.kernels.quantized_matmul import QuantizedLayout, quantized_matmul, triton_unsupported_reason

if TYPE_CHECKING:
    from cbrun.kernels.fused_moe import ExpertWeights

#: Dequantize at most about this many weight elements at once (4 MiB of float32): the transient a GEMM call adds.
DEQUANT_CHUNK_ELEMENTS = 1 << 20


class QuantizedTensors:
    """Weights kept quantized in memory, a linear's (``QuantizedLinearWeight``) or a MoE layer's stacked experts'
    (``ExpertStack``): what both answer. ``dtype``: the dtype the GEMM computes in."""

    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """The real weight's shape."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it holds in memory."""
        raise NotImplementedError


class QuantizedLinearWeight(QuantizedTensors):
    """A linear layer's weight kept quantized in memory, dequantized by ``quantized_linear`` chunk by chunk.

    Each layout is a dataclass over this base (``QuantizedWeight``: float8 with block scales;
    ``cbrun.engine.model.layers.quantization.int4.Int4Weight``: 4-bit codes with group scales). Subclasses define
    ``shape`` ((out_features, in_features)), ``device``, ``dtype`` (the dtype the GEMM computes in), ``storage_dtype``
    (what the values are stored as, for the log), ``tensors()``, ``rows_per_chunk()``,
    ``dequantize(start, stop)`` and ``kernel_layout`` (its tensors as the GPU kernels take them).
    """

    @property
    def storage_dtype(self) -> str:
        raise NotImplementedError

    def rows_per_chunk(self) -> int:
        """Output rows ``quantized_linear`` dequantizes at once."""
        raise NotImplementedError

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Output rows ``[start, stop)`` of the real weight, (stop - start, in_features) in ``dtype``."""
        raise NotImplementedError

    @property
    def kernel_layout(self) -> QuantizedLayout:
        """Its tensors as ``cbrun.kernels.quantized_matmul``'s layout (the same tensors, nothing copied), which the
        Triton GEMM reads; built and checked once, on first use."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes it holds in memory."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def quantized_linear(x: torch.Tensor, weight: QuantizedLinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, dequantize(weight), bias)`` without the whole real weight ever existing: on CUDA the Triton GEMM
    that dequantizes in its inner loop (``triton_quantized_linear``), elsewhere (and for a layout the Triton GEMM
    cannot step through, ``triton_unsupported_reason``) ``chunked_quantized_linear``.

    Args:
        x: (T, in_features) in ``weight.dtype``.
        weight: the quantized weight, on x's device.
        bias: (out_features,) in x's dtype, or None.

    Returns:
        (T, out_features) in ``x.dtype``.
    """
    if x.device.type == "cuda" and triton_unsupported_reason(weight.kernel_layout) is None:
        return triton_quantized_linear(x, weight, bias)
    return chunked_quantized_linear(x, weight, bias)


def triton_quantized_linear(x: torch.Tensor, weight: QuantizedLinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The GPU path: ``cbrun.kernels.quantized_matmul`` with the Triton kernel of the weight's layout (int4_gemm,
    fp8_gemm), weight-only (x is not quantized), so the products are the dequantized weight's up to summation
    order. On a CPU tensor it runs in Triton's interpreter (how the tests check it).

    Raises:
        ValueError: from the kernel's wrapper, for a layout it cannot step through (an int4 group size that is
            not a multiple of 16).
    """
    return quantized_matmul(x, weight.kernel_layout, bias, backend="triton")


def chunked_quantized_linear(x: torch.Tensor, weight: QuantizedLinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, dequantize(weight), bias)``, dequantizing ``weight.rows_per_chunk()`` output rows at a time,
    so the whole real weight never exists at once (the CPU path).

    Args:
        x: (T, in_features) in ``weight.dtype``.
        weight: the quantized weight.
        bias: (out_features,) or None.

    Returns:
        (T, out_features) in ``x.dtype``. A weight of one chunk (at most ``DEQUANT_CHUNK_ELEMENTS`` elements, or
        one float8 block row) is one ``F.linear`` call, the same bits as ``F.linear`` on the dequantized weight.
    """
    rows, out_features = weight.rows_per_chunk(), weight.shape[0]
    if rows >= out_features:
        return F.linear(x, weight.dequantize(), bias)
    parts = [F.linear(x, weight.dequantize(r, min(r + rows, out_features))) for r in range(0, out_features, rows)]
    out = torch.cat(parts, dim=-1)
    return out if bias is None else out + bias


class ExpertStack(QuantizedTensors):
    """A MoE layer's stacked expert weights (E, out, in) kept quantized in memory, dequantized by the MoE block
    (``cbrun.engine.model.layers.moe.SparseMoE``) a chunk of experts at a time. Subclasses: ``QuantizedExperts`` (per-expert
    quantized linears), ``cbrun.engine.model.layers.quantization.mxfp4.Mxfp4Experts`` (gpt-oss's stacked MXFP4). Its
    ``shape`` is (E, out, in)."""

    def dequantize(self, experts: slice = slice(None)) -> torch.Tensor:
        """(E', out, in) the real weights of ``experts`` (default all), in ``dtype``."""
        raise NotImplementedError


@dataclass
class QuantizedExperts(ExpertStack):
    """A MoE layer's stacked expert weights kept quantized: per expert, the quantized weights whose output rows
    are concatenated (gate then up for ``gate_up``; one for ``down``).

    ``dequantize`` gives the (E', out, in) stack the grouped GEMM reads, in ``dtype``: the MoE block dequantizes
    a chunk of its layer's experts at a time in each forward (``cbrun.engine.model.layers.moe.SparseMoE``), so the
    transient is one chunk of experts, never the model's.

    Attributes:
        experts: per expert, its parts (each (out_i, in), one input width).
        dtype: the dtype the GEMM computes in.
    """

    experts: list[list[QuantizedLinearWeight]]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        parts = self.experts[0]
        return torch.Size((len(self.experts), sum(p.shape[0] for p in parts), parts[0].shape[1]))

    @property
    def device(self) -> torch.device:
        return self.experts[0][0].device

    def tensors(self) -> list[torch.Tensor]:
        return [t for parts in self.experts for p in parts for t in p.tensors()]

    def dequantize(self, experts: slice = slice(None)) -> torch.Tensor:
        """(E', out, in) the real weights of ``experts`` (default all), in ``dtype``."""
        return torch.stack([torch.cat([p.dequantize() for p in parts]) for parts in self.experts[experts]])

    def stack_for_kernel(self) -> list[ExpertWeights]:
        """Each part's experts (gate and up, or down) stacked as one ``cbrun.kernels.fused_moe.ExpertWeights``, the
        (E, ...) tensors the fused MoE kernel reads, and each expert's weight rebound to views of the stacks, so
        the layer's quantized bytes are held once. Called once, at load (``SparseMoE`` on the Triton path); the
        transient is one part's tensors. Imports Triton.

        Raises:
            ValueError: the experts' weights differ in format, shape or block.
        """
        from cbrun.kernels.fused_moe import layout_views, stack_layouts

        stacks = []
        for p in range(len(self.experts[0])):
            layouts = [parts[p].kernel_layout for parts in self.experts]
            stack = stack_layouts(layouts)
            for e, parts in enumerate(self.experts):
                views = layout_views(stack, layouts[e], e)
                weight: Any = parts[p]
                changes = {
                    f.name: views[id(getattr(weight, f.name))]
                    for f in dataclasses.fields(weight)
                    if id(getattr(weight, f.name)) in views
                }
                parts[p] = dataclasses.replace(weight, **changes)
            stacks.append(stack)
        return stacks
