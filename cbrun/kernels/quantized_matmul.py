"""One entry point for a linear over a quantized weight: ``quantized_matmul(x, weight, bias)``.

The weight is one of three layouts, each a frozen dataclass that checks its tensors when built (at load, once):

- ``Int4Layout``: int4 codes with a zero point and a scale per group (compressed-tensors ``pack-quantized``,
  GPTQ, AWQ, as ``cbrun.engine.model.layers.quantization.int4.Int4Weight`` holds them);
- ``Fp8Layout``: float8_e4m3fn with one scale per (bo, bi) block (the ``fp8`` 128 x 128 layout, per-channel,
  per-tensor: ``cbrun.engine.model.layers.quantization.fp8.QuantizedWeight``);
- ``Mxfp4Layout``: MXFP4 blocks and E8M0 scales (gpt-oss's experts, one expert's (N, K) weight).

Which GEMM runs (``backend="auto"``):

    CUDA tensors  -> the Triton kernel that dequantizes in its inner loop (int4_gemm / fp8_gemm / mxfp4_gemm)
    CPU tensors   -> dequantize CPU_CHUNK_ELEMENTS weight elements at a time (the C kernels of cpu_dequant, or
                     the PyTorch reference where they do not build), one F.linear per chunk
    FP8 with fp8_activation_scheme "dynamic", either device -> fp8_scaled_mm (W8A8, opt-in: sm_89+ on CUDA;
                     PyTorch's own torch._scaled_mm on the CPU)

``backend="triton"`` forces the Triton kernel (in the interpreter on the CPU: how the tests run it) and ``"cpu"``
the chunked path on any device. Every path equals ``quantized_reference.dequantized_matmul_ref`` up to summation
order, except ``fp8_activation_scheme="dynamic"``, which rounds the activations to float8 (see
``fp8_scaled_mm``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cbrun.kernels import cpu_dequant
from cbrun.kernels.fp8_scaled_mm import FP8_ACTIVATION_SCHEMES, cuda_capability, fp8_scaled_mm, select_fp8_gemm
from cbrun.kernels.gemm_checks import check_activations, check_fp8_weight, check_int4_weight, check_mxfp4_weight
from cbrun.kernels.quantized_reference import (
    MXFP4_BLOCK_SIZE,
    fp8_dequant_ref,
    int4_dequant_ref,
    mxfp4_blocks_2d,
    mxfp4_dequant_ref,
)

#: The CPU path dequantizes at most about this many weight elements at once (4 MiB of float32), so the whole real
#: weight never exists (the engine's ``DEQUANT_CHUNK_ELEMENTS``).
CPU_CHUNK_ELEMENTS = 1 << 20
BACKENDS = ("auto", "triton", "cpu")


@dataclass(frozen=True)
class Int4Layout:
    """An int4 group-quantized weight (N, in_features): real value ``float32(code - zero) * scale``.

    Attributes:
        packed: (N, ceil(in_features / 8)) int32, code ``8w + i`` in bits ``4i`` of word ``w``.
        zeros: (N, groups) uint8 0..15. scales: (N, groups) float32, groups = ceil(in_features / group_size).
        in_features: K. group_size: inputs per group.

    Raises:
        ValueError: a tensor's shape, dtype or device is not the layout's.
    """

    packed: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    in_features: int
    group_size: int

    def __post_init__(self) -> None:
        check_int4_weight("Int4Layout", self.packed, self.zeros, self.scales, self.in_features, self.group_size)

    @property
    def device(self) -> torch.device:
        """Where the tensors are."""
        return self.packed.device

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return (self.packed.shape[0], self.in_features)

    def dequantize(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[start, stop)`` of the real weight in ``dtype`` (in C on the CPU where it builds)."""
        fast = cpu_dequant.int4_dequant(
            self.packed, self.zeros, self.scales, self.in_features, self.group_size, start, stop
        )
        if fast is not None:
            return fast.to(dtype)
        return int4_dequant_ref(
            self.packed, self.zeros, self.scales, self.in_features, self.group_size, dtype, start, stop
        )


@dataclass(frozen=True)
class Fp8Layout:
    """A float8 e4m3 weight (N, K) with one float32 scale per (bo, bi) block: real value ``float32(q) * scale``.

    Attributes:
        qweight: (N, K) float8_e4m3fn. scale: (ceil(N / bo), ceil(K / bi)) float32.
        block: (bo, bi): (128, 128) for ``fp8`` checkpoints, (1, K) per channel, (N, K) per tensor.

    Raises:
        ValueError: a tensor's shape, dtype or device is not the layout's.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def __post_init__(self) -> None:
        check_fp8_weight("Fp8Layout", self.qweight, self.scale, self.block)

    @property
    def device(self) -> torch.device:
        """Where the tensors are."""
        return self.qweight.device

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return (self.qweight.shape[0], self.qweight.shape[1])

    def dequantize(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[start, stop)`` of the real weight in ``dtype`` (in C on the CPU where it builds)."""
        fast = cpu_dequant.fp8_block_dequant(self.qweight, self.scale, self.block, start, stop)
        if fast is not None:
            return fast.to(dtype)
        return fp8_dequant_ref(self.qweight, self.scale, self.block, dtype, start, stop)


@dataclass(frozen=True)
class Mxfp4Layout:
    """An MXFP4 weight (N, K): real value ``ldexp(e2m1(code), scale - 127)``, one scale per 32 inputs.

    Attributes:
        blocks: (N, K / 32, 16) uint8 (one expert's ``*_blocks`` as the checkpoint stores them) or (N, K / 2).
        scales: (N, K / 32) uint8 E8M0 exponents.

    Raises:
        ValueError: a tensor's shape, dtype or device is not the layout's.
    """

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        check_mxfp4_weight("Mxfp4Layout", self.blocks, self.scales, mxfp4_blocks_2d(self.blocks).shape[1] * 2)

    @property
    def device(self) -> torch.device:
        """Where the tensors are."""
        return self.blocks.device

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return (self.blocks.shape[0], self.scales.shape[1] * MXFP4_BLOCK_SIZE)

    def dequantize(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[start, stop)`` of the real weight in ``dtype`` (in C on the CPU where it builds)."""
        data = mxfp4_blocks_2d(self.blocks)
        fast = cpu_dequant.mxfp4_dequant(data, self.scales, start, stop)
        return mxfp4_dequant_ref(data, self.scales, dtype, start, stop) if fast is None else fast.to(dtype)


QuantizedLayout = Int4Layout | Fp8Layout | Mxfp4Layout


def triton_unsupported_reason(weight: QuantizedLayout) -> str | None:
    """Why the Triton GEMM cannot step through ``weight`` (a scale group or block shorter than K and not a multiple
    of 16: no ``tl.dot`` step fits in it), or None when it can. The CPU path runs any layout."""
    k = weight.shape[1]
    if isinstance(weight, Int4Layout):
        what, group = "int4 group_size", weight.group_size
    elif isinstance(weight, Fp8Layout):
        what, group = "fp8 scale block bi", weight.block[1]
    else:
        return None
    if group < k and group % 16:
        return f"{what} {group} is not a multiple of 16"
    return None


def quantized_matmul(
    x: torch.Tensor,
    weight: QuantizedLayout,
    bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    fp8_activation_scheme: str = "none",
) -> torch.Tensor:
    """``F.linear(x, dequantize(weight), bias)`` without the dequantized weight ever existing whole.

    Args:
        x: (..., K) fp16/bf16/fp32 on the weight's device, last dim contiguous.
        weight: an ``Int4Layout``, ``Fp8Layout`` or ``Mxfp4Layout`` of shape (N, K).
        bias: (N,) in x's dtype, or None.
        backend: ``"auto"`` (Triton on CUDA, the chunked path on the CPU), ``"triton"`` or ``"cpu"``.
        fp8_activation_scheme: ``"none"`` (weight-only, the default) or ``"dynamic"`` (an ``Fp8Layout`` runs
            W8A8 with ``torch._scaled_mm``, whatever ``backend`` says; see ``fp8_scaled_mm.select_fp8_gemm`` for
            where it is refused; another layout refuses it).

    Returns:
        (..., N) in x's dtype.

    Raises:
        ValueError: a bad backend or scheme, a layout a path cannot run (naming why), or bad ``x`` / ``bias``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    out_features, in_features = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    device = weight.device
    if isinstance(weight, Fp8Layout):
        capability = cuda_capability(x.device)
        chosen = select_fp8_gemm(fp8_activation_scheme, capability, x.dtype, weight.block, weight.shape)
        if chosen == "scaled_mm":
            check_activations("quantized_matmul", x2, out_features, in_features, device, bias, None)
            return fp8_scaled_mm(x2, weight.qweight, weight.scale, bias).reshape(*lead, out_features)
    else:
        _check_weight_only_scheme(fp8_activation_scheme, weight)
    use_triton = backend == "triton" or (backend == "auto" and x.device.type == "cuda")
    if use_triton:
        out = _triton(weight)(x2, weight, bias)
    else:
        out = _chunked(x2, weight, bias, device)
    return out.reshape(*lead, out_features)


def _check_weight_only_scheme(fp8_activation_scheme: str, weight: QuantizedLayout) -> None:
    """ValueError unless ``fp8_activation_scheme`` is "none" for a layout that is not FP8 (an unknown value, or
    "dynamic", which has no FP8 weight to multiply with)."""
    if fp8_activation_scheme not in FP8_ACTIVATION_SCHEMES:
        raise ValueError(
            f"fp8_activation_scheme must be one of {FP8_ACTIVATION_SCHEMES}, got {fp8_activation_scheme!r}"
        )
    if fp8_activation_scheme != "none":
        raise ValueError(
            f'fp8_activation_scheme "{fp8_activation_scheme}" quantizes the activations of FP8 weights, and this '
            f"weight is an {type(weight).__name__}"
        )


def _triton(weight: QuantizedLayout) -> Callable[..., torch.Tensor]:
    """The Triton wrapper for ``weight``'s layout, imported on first use (CPU-only installs may lack Triton)."""
    if isinstance(weight, Int4Layout):
        gemm = importlib.import_module("cbrun.kernels.int4_gemm").int4_matmul_triton
        return lambda x, w, b: gemm(x, w.packed, w.zeros, w.scales, w.in_features, w.group_size, b)
    if isinstance(weight, Fp8Layout):
        gemm = importlib.import_module("cbrun.kernels.fp8_gemm").fp8_matmul_triton
        return lambda x, w, b: gemm(x, w.qweight, w.scale, w.block, b)
    gemm = importlib.import_module("cbrun.kernels.mxfp4_gemm").mxfp4_matmul_triton
    return lambda x, w, b: gemm(x, w.blocks, w.scales, b)


def _chunked(x: torch.Tensor, weight: QuantizedLayout, bias: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The CPU path: dequantize about ``CPU_CHUNK_ELEMENTS`` weight elements at a time, one ``F.linear`` each."""
    out_features, in_features = weight.shape
    out = check_activations("quantized_matmul", x, out_features, in_features, device, bias, None)
    rows = max(1, min(out_features, CPU_CHUNK_ELEMENTS // in_features))
    for start in range(0, out_features, rows):
        stop = min(start + rows, out_features)
        chunk_bias = None if bias is None else bias[start:stop]
        out[:, start:stop] = F.linear(x, weight.dequantize(start, stop, x.dtype), chunk_bias)
    return out
