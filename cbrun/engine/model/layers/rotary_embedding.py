"""Rotary position embedding (RoPE: Su et al. 2021, "RoFormer"), as the lean path computes it: the config's RoPE
parameters read without transformers, the inverse frequencies, the per-position cos/sin tables and their
application, each with transformers' operations, so the rotated queries and keys are the same floats.

Only the default RoPE is implemented. Another type (linear, dynamic, YaRN, ...) is one more entry in
``ROPE_INIT`` (its inverse frequencies and attention scaling from the config's parameters) and its parameter keys
in ``ROPE_KEYS``; ``read_rope_parameters`` refuses every type without one, by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

DEFAULT_ROPE_THETA = 10_000.0  # transformers' ``RotaryEmbeddingConfigMixin.default_theta``


@dataclass(frozen=True)
class RopeParameters:
    """A config's RoPE: its type (transformers' ``rope_type``) and base ``theta``."""

    rope_type: str
    theta: float


def default_rope_inv_freq(rope_theta: float, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies of the default RoPE, computed with the same operations as
    transformers' ``compute_default_rope_parameters``: ``1 / theta ** (arange(0, d, 2) / d)``."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return inv_freq.to(device)  # computed on the CPU, as transformers does before moving the model


def _default_init(rope: RopeParameters, head_dim: int, device: torch.device | str) -> tuple[torch.Tensor, float]:
    return default_rope_inv_freq(rope.theta, head_dim, device), 1.0


#: rope_type -> (parameters, head_dim, device) -> ((head_dim / 2,) float32 inverse frequencies, the attention
#: scaling on cos and sin): the RoPE types the lean path implements.
ROPE_INIT: dict[str, Callable[[RopeParameters, int, torch.device | str], tuple[torch.Tensor, float]]] = {
    "default": _default_init,
}
#: rope_type -> the keys its parameters may hold (besides the type itself and ``rope_theta``).
ROPE_KEYS: dict[str, frozenset[str]] = {"default": frozenset()}


def read_rope_parameters(raw: dict) -> tuple[RopeParameters | None, str | None]:
    """config.json's RoPE, resolved as transformers' ``convert_rope_params_to_dict`` does: ``rope_scaling``
    (legacy) or ``rope_parameters``, whose ``rope_theta`` wins over a top-level ``rope_theta``, else 10000; or
    ``(None, why)`` for a type or a key ``ROPE_INIT`` / ``ROPE_KEYS`` do not implement."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        return None, f"RoPE parameters {params!r} (only the default RoPE is implemented)"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_INIT:
        if set(params) - {"rope_type", "type", "rope_theta"}:
            return None, f"RoPE parameters {params!r} (only the default RoPE is implemented)"
        return None, f"rope_type {rope_type!r} (only the default RoPE is implemented)"
    if set(params) - {"rope_type", "type", "rope_theta"} - ROPE_KEYS[rope_type]:
        return None, f"RoPE parameters {params!r} (only the default RoPE is implemented)"
    return RopeParameters(rope_type, params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))), None


def rope_inv_freq(rope: RopeParameters, head_dim: int, device: torch.device | str) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim / 2,) float32, attention scaling) of a RoPE ``read_rope_parameters`` gave."""
    return ROPE_INIT[rope.rope_type](rope, head_dim, device)


def unsupported_rotary_reason(rotary_emb: torch.nn.Module) -> str | None:
    """Why a transformers rotary-embedding module is not one ``ROPE_INIT`` implements, or None."""
    rope_type = getattr(rotary_emb, "rope_type", None)
    if rope_type not in ROPE_INIT:
        return f"rope_type {rope_type!r} (only the default RoPE is implemented)"
    return None


def rope_tables(
    inv_freq: torch.Tensor, attention_scaling: float, max_positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_positions, head_dim) cos and sign-folded sin tables, from the model's own ``inv_freq``.

    Computed with transformers' RoPE operations (float32 angles ``position * inv_freq``, duplicated over both
    halves, cos/sin, times ``attention_scaling``, cast to the model dtype), so a row equals what transformers
    computes for that position. The sin table's first half is negated: ``rotate_half(x) * sin`` then becomes
    ``roll(x, head_dim / 2) * sin_signed``, the same products up to an exact sign flip.
    """
    inv_freq = inv_freq.float()
    positions = torch.arange(max_positions, device=inv_freq.device, dtype=torch.int64)
    freqs = positions[:, None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos = (angles.cos() * attention_scaling).to(dtype)
    sin = (angles.sin() * attention_scaling).to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE on (T, heads, head_dim), rotating the two halves of each head (transformers' ``rotate_half``).

    Args:
        x: (T, heads, head_dim); cos, sin_signed: (T, 1, head_dim) the tables' rows at the tokens' positions.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed
