"""Argument checks of the quantized GEMMs (the Triton wrappers and ``quantized_matmul``'s layouts), without Triton:
the CPU path uses them too. One copy of each weight format's layout rules (``check_int4_weight``,
``check_fp8_weight``, ``check_mxfp4_weight``), so a layout the CPU path accepts is the layout the kernels take."""

from __future__ import annotations

import torch

from cbrun.kernels.quantized_reference import MXFP4_BLOCK_SIZE, mxfp4_blocks_2d

#: Activation dtypes the GEMMs take.
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_activations(
    kernel: str,
    x: torch.Tensor,
    out_features: int,
    in_features: int,
    weight_device: torch.device,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Checks ``x``, ``bias`` and ``out`` of a quantized GEMM and returns the output buffer.

    Args:
        kernel: the wrapper's name, for errors.
        x: (M, K) fp16/bf16/fp32, last dim contiguous. out_features, in_features: N and K of the weight.
        weight_device: where the weight's tensors are.
        bias: (N,) in x's dtype, contiguous, or None. out: (M, N) in x's dtype, last dim contiguous, or None.

    Returns:
        ``out``, or a new (M, N) tensor.

    Raises:
        ValueError: naming the argument whose shape, dtype, stride or device is wrong.
    """
    if x.dim() != 2:
        raise ValueError(f"{kernel}: x must be (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{kernel}: x dtype must be one of {ACTIVATION_DTYPES}, got {x.dtype}")
    if x.shape[1] != in_features:
        raise ValueError(f"{kernel}: x has {x.shape[1]} features, the weight takes {in_features}")
    if x.shape[0] and x.stride(1) != 1:
        raise ValueError(f"{kernel}: x must be contiguous in its last dim, got strides {x.stride()}")
    if x.device != weight_device:
        raise ValueError(f"{kernel}: x is on {x.device}, the weight on {weight_device}")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(
            f"{kernel}: bias must be a contiguous ({out_features},) tensor in {x.dtype}, got {bias.dtype} "
            f"{tuple(bias.shape)} strides {bias.stride()}"
        )
    if bias is not None and bias.device != x.device:
        raise ValueError(f"{kernel}: bias is on {bias.device}, x on {x.device}")
    if out is None:
        return torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    if out.shape != (x.shape[0], out_features) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"{kernel}: out must be ({x.shape[0]}, {out_features}) {x.dtype} on {x.device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    if out.shape[0] and out.stride(1) != 1:
        raise ValueError(f"{kernel}: out must be contiguous in its last dim, got strides {out.stride()}")
    return out


def check_weight_tensor(kernel: str, name: str, tensor: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    """One tensor of a quantized weight: exact shape and dtype, rows contiguous in their last dim.

    Raises:
        ValueError: naming the tensor, what it is and what the layout needs.
    """
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise ValueError(
            f"{kernel}: {name} must be {dtype} of shape {tuple(shape)}, got {tensor.dtype} {tuple(tensor.shape)}"
        )
    if tensor.dim() == 2 and tensor.shape[1] > 1 and tensor.stride(1) != 1:
        raise ValueError(f"{kernel}: {name} must be contiguous in its last dim, got strides {tensor.stride()}")


def check_same_device(kernel: str, *tensors: torch.Tensor) -> None:
    """Raises ValueError (naming the devices) unless the tensors of one weight share one device."""
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{kernel}: its tensors are on several devices: {sorted({str(t.device) for t in tensors})}")


def check_int4_weight(
    kernel: str, packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, in_features: int, group_size: int
) -> None:
    """An int4 group-quantized weight (N, in_features), ``quantized_reference.int4_dequant_ref``'s layout.

    Args:
        kernel: the caller's name, for errors.
        packed: (N, ceil(K / 8)) int32. zeros: (N, groups) uint8. scales: (N, groups) float32, groups =
            ceil(K / group_size); each contiguous in its last dim, all on one device.
        in_features: K. group_size: inputs per group, positive.

    Raises:
        ValueError: naming the tensor or setting that is not the layout's.
    """
    if packed.dim() != 2 or isinstance(group_size, bool) or int(group_size) < 1 or in_features < 1:
        raise ValueError(
            f"{kernel}: packed must be (N, ceil(K / 8)) int32, group_size and in_features positive, got "
            f"{tuple(packed.shape)}, {group_size!r}, {in_features!r}"
        )
    n, groups = packed.shape[0], -(-in_features // int(group_size))
    check_weight_tensor(kernel, "packed", packed, (n, -(-in_features // 8)), torch.int32)
    check_weight_tensor(kernel, "zeros", zeros, (n, groups), torch.uint8)
    check_weight_tensor(kernel, "scales", scales, (n, groups), torch.float32)
    check_same_device(kernel, packed, zeros, scales)


def check_fp8_weight(kernel: str, qweight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """A float8 e4m3 weight (N, K) with one float32 scale per (bo, bi) block,
    ``quantized_reference.fp8_dequant_ref``'s layout.

    Args:
        kernel: the caller's name, for errors.
        qweight: (N, K) float8_e4m3fn, contiguous in its last dim.
        scale: (ceil(N / bo), ceil(K / bi)) float32 (any strides: a per-tensor scale may be broadcast).
        block: (bo, bi), two positive ints.

    Raises:
        ValueError: naming the tensor or setting that is not the layout's.
    """
    if qweight.dim() != 2 or len(block) != 2 or any(isinstance(b, bool) or int(b) < 1 for b in block):
        raise ValueError(
            f"{kernel}: qweight must be (N, K) and block two positive ints (bo, bi), got {tuple(qweight.shape)} "
            f"and {block!r}"
        )
    (n, k), (bo, bi) = qweight.shape, (int(block[0]), int(block[1]))
    check_weight_tensor(kernel, "qweight", qweight, (n, k), torch.float8_e4m3fn)
    scale_shape = (-(-n // bo), -(-k // bi))
    if tuple(scale.shape) != scale_shape or scale.dtype != torch.float32:
        raise ValueError(
            f"{kernel}: scale must be float32 of shape {scale_shape} for block {(bo, bi)}, got {scale.dtype} "
            f"{tuple(scale.shape)}"
        )
    check_same_device(kernel, qweight, scale)


def check_mxfp4_weight(kernel: str, blocks: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """An MXFP4 weight (N, in_features), ``quantized_reference.mxfp4_dequant_ref``'s layout; returns its codes as
    the 2-D (N, K / 2) uint8 view the kernels read.

    Args:
        kernel: the caller's name, for errors.
        blocks: (N, K / 32, 16) uint8 (an expert's ``*_blocks`` as stored) or (N, K / 2), rows contiguous.
        scales: (N, K / 32) uint8 E8M0 exponents. in_features: K, a multiple of 32.

    Raises:
        ValueError: naming the tensor or setting that is not the layout's (K not a multiple of 32 included).
    """
    data = mxfp4_blocks_2d(blocks)
    if in_features % MXFP4_BLOCK_SIZE:
        raise ValueError(f"{kernel}: K = {in_features} is not a multiple of the MXFP4 block of {MXFP4_BLOCK_SIZE}")
    n = data.shape[0]
    check_weight_tensor(kernel, "blocks", data, (n, in_features // 2), torch.uint8)
    check_weight_tensor(kernel, "scales", scales, (n, in_features // MXFP4_BLOCK_SIZE), torch.uint8)
    check_same_device(kernel, data, scales)
    return data
