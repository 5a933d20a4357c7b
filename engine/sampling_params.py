"""Per-request sampling settings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

#: Names a job may override per row through an input column of the same name.
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stop_token_ids")


@dataclass
class SamplingParams:
    """How one request samples its tokens and when it stops.

    Attributes:
        max_new_tokens: most tokens to generate (>= 1).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_k: keep the k most likely tokens before sampling; 0 disables it.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability mass reaches top_p (0 < p <= 1).
        seed: seed of the request's own ``torch.Generator``; None draws from the engine's generator.
        stop_token_ids: extra token ids that end the request (the emitted stop token is kept in the output).
        ignore_eos: do not stop on the model's EOS token ids.

    Raises:
        ValueError: from ``validate`` when a value is out of range; the message names the setting.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(int(t) for t in (self.stop_token_ids or ()))

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting that is out of range."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    def replace(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` applied; unknown names raise ``ValueError``."""
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown sampling setting(s): {sorted(unknown)}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)
