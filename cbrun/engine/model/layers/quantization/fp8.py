"""float8 weights with block scales (``quant_method: "fp8"``, compressed-tensors ``float-quantized``): the weight
type and its dequantization (the PyTorch reference; C on the CPU through ``cbrun.kernels.cpu_dequant``), and the
opt-in W8A8 GEMM over it (``engine.fp8_activation_scheme = "dynamic"``: ``w8a8_linear``, refused by name where it
cannot run: ``w8a8_checkpoint_refusal`` before the weights are read, ``check_w8a8`` per weight)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from cbrun.engine.model.layers.quantization.base import DEQUANT_CHUNK_ELEMENTS, QuantizedLinearWeight
from cbrun.engine.model.layers.quantization.schemes import QuantScheme
from cbrun.kernels import cpu_dequant
from cbrun.kernels.fp8_scaled_mm import cuda_capability, select_fp8_gemm, w8a8_unavailable_reason
from cbrun.kernels.quantized_matmul import Fp8Layout, quantized_matmul

#: The float8 format both implemented float8 layouts store their weights in.
FP8_DTYPE = torch.float8_e4m3fn


@dataclass
class QuantizedWeight(QuantizedLinearWeight):
    """A linear layer's weight kept quantized in memory: float8_e4m3fn values and one scale per block.

    The real weight is ``qweight[i, j] * scale[i // bo, j // bi]`` (``dequantize``).

    Attributes:
        qweight: (out_features, in_features) float8_e4m3fn.
        scale: (ceil(out / bo), ceil(in / bi)) float32.
        block: (bo, bi).
        dtype: the dtype the GEMM computes in (the engine's).
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def storage_dtype(self) -> str:
        return str(self.qweight.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale]

    @cached_property
    def kernel_layout(self) -> Fp8Layout:
        """The same tensors as ``cbrun.kernels.quantized_matmul.Fp8Layout`` (the Triton GEMM's input)."""
        return Fp8Layout(self.qweight, self.scale, self.block)

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """``dequantize`` (the reference), in C on the CPU where it builds (the same bits, one pass)."""
        stop = self.shape[0] if stop is None else stop
        fast = cpu_dequant.fp8_block_dequant(self.qweight, self.scale, self.block, start, stop)
        return dequantize(self, start, stop) if fast is None else fast.to(self.dtype)

    def rows_per_chunk(self) -> int:
        """Output rows ``chunked_quantized_linear`` dequantizes at once: a multiple of ``bo``, about
        ``DEQUANT_CHUNK_ELEMENTS`` elements, at least one block row."""
        bo = self.block[0]
        rows = max(1, DEQUANT_CHUNK_ELEMENTS // (self.shape[1] * bo)) * bo
        return min(rows, self.shape[0])


def dequantize(weight: QuantizedWeight, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Output rows ``[start, stop)`` of the real weight, in ``weight.dtype`` (the PyTorch reference).

    Each value is ``float32(q) * float32(scale)`` rounded once to ``weight.dtype`` (float8 to float32 is exact).

    Args:
        start: a multiple of the block's ``bo``.
        stop: the end row (default: all).

    Returns:
        (stop - start, in_features).
    """
    bo, bi = weight.block
    stop = weight.shape[0] if stop is None else stop
    assert start % bo == 0, "chunks start on a block row"
    values = weight.qweight[start:stop].to(torch.float32)
    scale = weight.scale[start // bo : -(-stop // bo)]
    rows, in_features = values.shape
    if rows % bo == 0 and in_features % bi == 0:  # whole blocks: scale each in place, by broadcast
        blocks = values.view(rows // bo, bo, in_features // bi, bi)
        blocks.mul_(scale[:, None, :, None])
        return values.to(weight.dtype)
    scale = scale.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :in_features]
    return (values * scale).to(weight.dtype)


def w8a8_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """A linear layer under ``engine.fp8_activation_scheme = "dynamic"``: each row of ``x`` rounded to float8 with
    its own scale, multiplied with the float8 weight by ``torch._scaled_mm`` (``cbrun.kernels.fp8_scaled_mm``), on
    CUDA and on the CPU alike. ``check_w8a8`` accepted the weight at load.

    Args:
        x: (T, in_features) bfloat16. weight: per-channel or per-tensor float8. bias: (out_features,) or None.

    Returns:
        (T, out_features) bfloat16.
    """
    return quantized_matmul(x, weight.kernel_layout, bias, fp8_activation_scheme="dynamic")


def check_w8a8(weight: QuantizedWeight, name: str) -> None:
    """Refuse, at load, a weight ``w8a8_linear`` cannot run: the checks of ``select_fp8_gemm`` on the weight's
    device, dtype, scale block and shape.

    Raises:
        ValueError: naming the setting, the linear ``name`` and why.
    """
    try:
        select_fp8_gemm(
            "dynamic", cuda_capability(weight.device), weight.dtype, weight.block, weight.kernel_layout.shape
        )
    except ValueError as exc:
        raise ValueError(f"{exc} (linear {name})") from None


def w8a8_checkpoint_refusal(scheme: QuantScheme | None, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``engine.fp8_activation_scheme = "dynamic"`` cannot run a checkpoint quantized in ``scheme`` (None:
    unquantized) on ``device`` in ``dtype``, from config.json and the settings alone, before any weight is read
    (the words after ``cbrun.kernels.fp8_scaled_mm.W8A8``, ending in what to change); None where it may run (each
    weight is then checked by ``check_w8a8``).

    A checkpoint with no FP8 weight (unquantized, int4, MXFP4) is refused rather than run unchanged: the setting
    would do nothing, silently.
    """
    if scheme is None or scheme.layout != "float8":
        what = "is not quantized" if scheme is None else f"holds {scheme.method} ({scheme.layout}) weights"
        return (
            f"quantizes the activations of FP8 linear layers, and this checkpoint {what}: there is nothing to apply "
            'it to; set fp8_activation_scheme = "none"'
        )
    if scheme.block is not None and scheme.block[0] != 1:  # scales over blocks of rows: never whole rows
        bo, bi = scheme.block
        return (
            f"runs per-channel or per-tensor FP8 weights, not the fp8 weight_block_size [{bo}, {bi}] layout (that "
            'needs per-group activation scales); set fp8_activation_scheme = "none"'
        )
    if device.type not in ("cpu", "cuda"):
        return f'runs on CUDA or the CPU, not {device.type}; set fp8_activation_scheme = "none"'
    return w8a8_unavailable_reason(cuda_capability(device), dtype)
