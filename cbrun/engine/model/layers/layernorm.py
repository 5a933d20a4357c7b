"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), in the order of operations of
transformers' Llama-family ``RMSNorm`` modules, so the lean path's norms are the same floats."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension: computed in float32, cast back to ``x``'s
    dtype, then scaled (the family's order of operations).

    Args:
        x: (..., n) activations; weight: (n,) in ``x``'s dtype; eps: the norm's epsilon.

    Returns:
        (..., n) in ``x``'s dtype.
    """
    if x.dtype == torch.float32:  # the casts would be no-ops; skipping them saves two calls per norm
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_float32_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled in float32, then cast (gpt-oss's ``GptOssRMSNorm``, whose weights transformers keeps in
    float32: ``_keep_in_fp32_modules``): ``(weight * normed_float32).to(x.dtype)``. In float32 it is ``rms_norm``'s
    floats.

    Args:
        x: (..., n) activations; weight: (n,) float32 (or ``x``'s dtype: it is multiplied as float32); eps: the
            norm's epsilon.

    Returns:
        (..., n) in ``x``'s dtype.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)
