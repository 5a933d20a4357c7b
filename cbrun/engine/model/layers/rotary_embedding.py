"""Rotary position embedding (RoPE: Su et al. 2021, "RoFormer"), as the lean path computes it: the config's RoPE
parameters read without transformers, the inverse frequencies, the per-position cos/sin tables and their
application, each with transformers' operations, so the rotated queries and keys are the same floats.

Implemented: the default RoPE and YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
Language Models"; gpt-oss's, and any Llama-style family's ``rope_type: "yarn"``). Another type (linear, dynamic,
llama3, ...) is one more entry in ``ROPE_INIT`` (its inverse frequencies and attention scaling from the config's
parameters) and its parameter keys in ``ROPE_KEYS``; ``read_rope_parameters`` refuses every type without one, by
name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_ROPE_THETA = 10_000.0  # transformers' ``RotaryEmbeddingConfigMixin.default_theta``


@dataclass(frozen=True)
class RopeParameters:
    """A config's RoPE: its type (transformers' ``rope_type``), base ``theta`` and the type's other parameters
    (``(key, value)`` pairs, sorted; YaRN's ``factor``, ``beta_fast``, ...), as ``read_rope_parameters`` resolved
    them."""

    rope_type: str
    theta: float
    params: tuple[tuple[str, object], ...] = field(default=())


def default_rope_inv_freq(rope_theta: float, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies of the default RoPE, computed with the same operations as
    transformers' ``compute_default_rope_parameters``: ``1 / theta ** (arange(0, d, 2) / d)``."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return inv_freq.to(device)  # computed on the CPU, as transformers does before moving the model


def _default_init(rope: RopeParameters, head_dim: int, device: torch.device | str) -> tuple[torch.Tensor, float]:
    return default_rope_inv_freq(rope.theta, head_dim, device), 1.0


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1), as transformers'
    ``yarn_get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_init(rope: RopeParameters, head_dim: int, device: torch.device | str) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies (a linear ramp between the interpolated ``1 / (factor * theta^(2i/d))`` and the
    original frequencies over the dimensions whose wavelengths fall between ``beta_fast`` and ``beta_slow``
    rotations of the original context) and its attention scaling, with the operations and defaults of
    transformers 5's ``_compute_yarn_parameters`` (``truncate`` defaults to True, ``beta_fast`` / ``beta_slow`` to
    32 / 1 when unset or zero), so the tables are the same floats. ``read_rope_parameters`` has already filled
    ``factor`` and ``original_max_position_embeddings``."""
    params: dict[str, Any] = dict(rope.params)
    base, dim = rope.theta, head_dim
    factor, original = params["factor"], params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.to(device), attention_factor


#: rope_type -> (parameters, head_dim, device) -> ((head_dim / 2,) float32 inverse frequencies, the attention
#: scaling on cos and sin): the RoPE types the lean path implements.
ROPE_INIT: dict[str, Callable[[RopeParameters, int, torch.device | str], tuple[torch.Tensor, float]]] = {
    "default": _default_init,
    "yarn": _yarn_init,
}
#: rope_type -> the keys its parameters may hold (besides the type itself and ``rope_theta``).
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "yarn": frozenset(
        {
            "factor",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "original_max_position_embeddings",
            "truncate",
        }
    ),
}
IMPLEMENTED = "the default RoPE and YaRN are implemented"


def read_rope_parameters(
    raw: dict, default_theta: float = DEFAULT_ROPE_THETA, default_parameters: dict | None = None
) -> tuple[RopeParameters | None, str | None]:
    """config.json's RoPE, resolved as transformers' ``convert_rope_params_to_dict`` / ``standardize_rope_params``
    do: ``rope_scaling`` (legacy) or ``rope_parameters`` (else the family's ``default_parameters``), whose
    ``rope_theta`` wins over a top-level ``rope_theta``, else the family's ``default_theta``; YaRN's
    ``original_max_position_embeddings`` defaults to ``max_position_embeddings`` and a null ``factor`` to their
    ratio. Or ``(None, why)`` for a type or a key ``ROPE_INIT`` / ``ROPE_KEYS`` do not implement."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or dict(default_parameters or {})
    if not isinstance(params, dict):
        return None, f"RoPE parameters {params!r} ({IMPLEMENTED})"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_INIT:
        if set(params) - {"rope_type", "type", "rope_theta"}:
            return None, f"RoPE parameters {params!r} ({IMPLEMENTED})"
        return None, f"rope_type {rope_type!r} ({IMPLEMENTED})"
    if set(params) - {"rope_type", "type", "rope_theta"} - ROPE_KEYS[rope_type]:
        return None, f"RoPE parameters {params!r} ({IMPLEMENTED})"
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    extra = {k: v for k, v in params.items() if k in ROPE_KEYS[rope_type]}
    if rope_type == "yarn":
        original = extra.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
        if not isinstance(original, (int, float)) or isinstance(original, bool) or original <= 0:
            return None, f"YaRN's original_max_position_embeddings = {original!r} is not a positive number"
        if extra.get("factor") is None:
            extra["factor"] = raw["max_position_embeddings"] / original
        for key in ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            value = extra.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                return None, f"YaRN's {key} = {value!r} is not a number"
    return RopeParameters(rope_type, theta, tuple(sorted(extra.items()))), None


def rope_inv_freq(rope: RopeParameters, head_dim: int, device: torch.device | str) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim / 2,) float32, attention scaling) of a RoPE ``read_rope_parameters`` gave."""
    return ROPE_INIT[rope.rope_type](rope, head_dim, device)


def unsupported_rotary_reason(rotary_emb: torch.nn.Module) -> str | None:
    """Why a transformers rotary-embedding module is not one ``ROPE_INIT`` implements, or None."""
    rope_type = getattr(rotary_emb, "rope_type", None)
    if rope_type not in ROPE_INIT:
        return f"rope_type {rope_type!r} ({IMPLEMENTED})"
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
