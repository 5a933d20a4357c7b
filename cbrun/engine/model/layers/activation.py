"""The gated MLP's activation: ``silu(gate) * up`` (SwiGLU: Shazeer 2020, "GLU Variants Improve Transformer")."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, in place in ``gate``: the same values, one (T, I) tensor fewer.

    Args:
        gate, up: (T, I) in the model's dtype; ``gate`` is overwritten.

    Returns:
        ``gate`` itself, (T, I).
    """
    return F.silu(gate, inplace=True).mul_(up)
