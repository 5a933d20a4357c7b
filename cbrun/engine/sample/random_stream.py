"""A counter-based random stream: each uniform number is a pure function of (seed, position, draw index).

A request's draws never come from a stateful generator: the number used for its token at output position ``t``
and draw ``d`` is ``uniform(seed, t, d)``, the SplitMix64 finaliser (Steele, Lea and Flood 2014, "Fast splittable
pseudorandom number generators"; the constants are Vigna's ``splitmix64.c``) chained over the three integers. So
a row's tokens do not depend on its batch, the step it runs in, preemption and resume, or the device: the same
integer arithmetic runs on any device (int64 multiplication wraps modulo 2**64 on every torch backend; right
shifts are arithmetic on int64, so a logical shift is a shift and a mask).

The draw indices a sampler uses are named here, so two uses never share a number.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)

#: Draw indices. A plain draw's rejection rounds use ``PLAIN + round``; speculative verification uses one number
#: to accept a proposal and one to draw its replacement; a draft model's proposal its own.
PLAIN = 0
ACCEPT = 1 << 20
RESIDUAL = ACCEPT + 1
DRAFT = ACCEPT + 2


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values read as unsigned."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of ``x + golden``, elementwise over int64 (a bijection of 64-bit patterns)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def stream_key(seed: int) -> int:
    """A request seed (any Python int) as the int64 the stream takes (its low 64 bits)."""
    return _signed(seed)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, draws: torch.Tensor | int) -> torch.Tensor:
    """One uniform number in (0, 1) per row: a pure function of the three integers.

    Args:
        seeds: (R,) int64 stream keys (``stream_key``).
        positions: (R,) int64 output positions of the tokens being drawn.
        draws: (R,) int64 or an int: the draw index (``PLAIN``, ``ACCEPT``, ...).

    Returns:
        (R,) float64 on the seeds' device, ``(top 53 bits + 0.5) / 2**53``, never 0 or 1.
    """
    h = mix64(mix64(mix64(seeds) + positions) + draws)
    return (_shr(h, 11).double() + 0.5) * 2.0**-53


def reference_uniform(seed: int, position: int, draw: int) -> float:
    """``uniform`` for one row in plain Python integers (the oracle of the tests)."""

    def mix(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    h = mix((mix((mix(seed & _MASK64) + position) & _MASK64) + draw) & _MASK64)
    return ((h >> 11) + 0.5) * 2.0**-53
