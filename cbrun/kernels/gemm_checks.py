"""Argument checks of the quantized GEMMs (the Triton wrappers and ``quantized_matmul``'s layouts), without Triton:
the CPU path uses them too."""

from __future__ import annotations

import torch

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
