"""Dequantizing quantized linear weights on the CPU in C (``cpu_dequant.c``), a chunk of output rows at a time.

The lean path's quantized GEMM (``cbrun.engine.model.layers.quantization.base.quantized_linear``) dequantizes each chunk of a
weight before the dense GEMM; in PyTorch that is several passes over the chunk (float8 to float32 alone runs about
4 ns an element on a 2-core EPYC), here one. The values are the PyTorch references' bits (one product per value,
no fused multiply-add; ``tests/kernels/test_cpu_dequant.py`` checks them ``torch.equal``). Built with
``cbrun.kernels.c_build`` on first use; where it cannot build, ``unavailable_reason`` says why and the callers run
their PyTorch reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from cbrun.kernels.c_build import KernelLibrary

SOURCE = Path(__file__).with_name("cpu_dequant.c")
_FP8_LUT: torch.Tensor | None = None


def unavailable_reason() -> str | None:
    """Why the C kernels cannot run here (building them on first call), or None when they can."""
    return _LIBRARY.unavailable_reason()


def fp8_block_dequant(
    qweight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], start: int, stop: int
) -> torch.Tensor | None:
    """Rows ``[start, stop)`` of ``qweight * scale`` per (bo, bi) block as float32, or None where the kernel does
    not apply (not the CPU, not contiguous, not built): the caller runs its PyTorch reference.

    Args:
        qweight: (out, in) float8_e4m3fn. scale: (ceil(out / bo), ceil(in / bi)) float32. block: (bo, bi).

    Returns:
        (stop - start, in) float32.
    """
    library = _applies(qweight, scale)
    if library is None or qweight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        return None
    global _FP8_LUT
    if _FP8_LUT is None:  # the 256 float8_e4m3fn values (NaN codes as torch converts them)
        _FP8_LUT = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    rows, cols = stop - start, qweight.shape[1]
    out = torch.empty(rows, cols, dtype=torch.float32)
    library.cbrun_fp8_block_dequant(
        qweight.data_ptr(), scale.data_ptr(), _FP8_LUT.data_ptr(), out.data_ptr(),
        start, rows, cols, block[0], block[1], scale.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return out


def int4_dequant(
    packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, in_features: int, group_size: int,
    start: int, stop: int,
) -> torch.Tensor | None:  # fmt: skip
    """Rows ``[start, stop)`` of ``(code - zero) * scale`` per group as float32, or None where the kernel does not
    apply (see ``fp8_block_dequant``).

    Args:
        packed: (out, ceil(in / 8)) int32, eight 4-bit codes a word (``cbrun.engine.model.layers.quantization.int4.Int4Weight``).
        zeros: (out, groups) uint8. scales: (out, groups) float32. group_size: input features per group.

    Returns:
        (stop - start, in_features) float32.
    """
    library = _applies(packed, zeros, scales)
    if library is None or packed.dtype != torch.int32 or zeros.dtype != torch.uint8 or scales.dtype != torch.float32:
        return None
    rows = stop - start
    out = torch.empty(rows, in_features, dtype=torch.float32)
    library.cbrun_int4_dequant(
        packed.data_ptr(), zeros.data_ptr(), scales.data_ptr(), out.data_ptr(),
        start, rows, in_features, packed.shape[1], scales.shape[1], group_size, torch.get_num_threads(),
    )  # fmt: skip
    return out


def mxfp4_dequant(blocks: torch.Tensor, scales: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
    """Rows ``[start, stop)`` of the real MXFP4 weight as float32, or None where the kernel does not apply (see
    ``fp8_block_dequant``): ``cbrun.kernels.quantized_reference.mxfp4_dequant_ref``'s values.

    Args:
        blocks: (N, K / 2) uint8, two FP4 E2M1 codes a byte, the low nibble first (the checkpoint's
            (N, K / 32, 16) flattened). scales: (N, K / 32) uint8 E8M0 exponents, K a multiple of 32.

    Returns:
        (stop - start, K) float32.
    """
    library = _applies(blocks, scales)
    if library is None or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 2:
        return None
    cols = blocks.shape[1] * 2
    if scales.shape != (blocks.shape[0], cols // 32) or cols % 32:
        return None
    out = torch.empty(stop - start, cols, dtype=torch.float32)
    library.cbrun_mxfp4_dequant(
        blocks.data_ptr(), scales.data_ptr(), out.data_ptr(), start, stop - start, cols, torch.get_num_threads()
    )
    return out


def _applies(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    return _LIBRARY.load()


def _bind(library: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    library.cbrun_fp8_block_dequant.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_int]
    library.cbrun_fp8_block_dequant.restype = None
    library.cbrun_int4_dequant.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_int]
    library.cbrun_int4_dequant.restype = None
    library.cbrun_mxfp4_dequant.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    library.cbrun_mxfp4_dequant.restype = None


_LIBRARY = KernelLibrary(SOURCE, "the CPU dequantization kernels", "about 1 s", _bind, "the PyTorch path")
