"""The gated MLP's activations: ``silu(gate) * up`` (SwiGLU: Shazeer 2020, "GLU Variants Improve Transformer"), for
dense MLPs and MoE experts, and gpt-oss's clamped SwiGLU for its experts."""

from __future__ import annotations

from dataclasses import dataclass

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


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """A MoE expert's ``silu(gate) * up`` from its stacked projection output (gate columns, then up columns: the
    layout Qwen3-MoE's and Mixtral's experts use).

    Args:
        gate_up: (S, 2I) in the model's dtype.

    Returns:
        (S, I), a new tensor.
    """
    width = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :width]) * gate_up[..., width:]


#: ``invariant_sigmoid`` pads to a multiple of this many elements: two of ATen's widest CPU vectors (AVX-512 on
#: 16-bit floats), so its vectorised loop has no scalar tail.
_SIGMOID_PAD = 64
#: and calls ``torch.sigmoid`` on pieces of at most ATen's elementwise grain size (one thread each).
_SIGMOID_PIECE = 32768


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid`` whose every element is the same bits whatever the tensor's length (``batch_invariant`` on
    the CPU): ATen computes a length's last few elements (its loop's tail) by the scalar function, whose bits
    differ from the vectorised one's. Here every element goes through the vectorised loop: the values are padded to
    a multiple of ``_SIGMOID_PAD`` and taken in pieces of ``_SIGMOID_PIECE``, each run by one thread.

    Args:
        x: any shape (Qwen2-MoE's (T, 1) shared-expert gate logits), on the CPU.

    Returns:
        ``sigmoid(x)``, the shape and dtype of ``x``.
    """
    flat = x.reshape(-1)
    padded = F.pad(flat, (0, -flat.numel() % _SIGMOID_PAD))
    out = torch.cat([torch.sigmoid(piece) for piece in padded.split(_SIGMOID_PIECE)])
    return out[: flat.numel()].view_as(x)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (vLLM's ``swigluoai_and_mul``): on interleaved gate/up columns
    (``gate = gate_up[..., 0::2]``, ``up = gate_up[..., 1::2]``)::

        gate = min(gate, limit);  up = clamp(up, -limit, limit)
        out = (up + 1) * (gate * sigmoid(alpha * gate))

    in the order of operations of transformers' ``GptOssExperts._apply_gate``, so the floats are the same.

    Attributes:
        alpha: the sigmoid's gain (``swiglu_alpha``, 1.702).
        limit: the clamp (``swiglu_limit``, 7.0).
    """

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(S, 2I) interleaved gate/up in the model's dtype -> (S, I)."""
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu
