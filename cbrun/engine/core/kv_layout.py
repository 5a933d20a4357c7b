"""Which layers attend fully and which slide a window, and how their pages tile the shared pool."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

#: A model's (text) config, read by attribute: transformers' ``PretrainedConfig`` or the lean path's
#: ``cbrun.engine.model.config.LlamaConfig`` (the engine's core imports neither).
ModelConfig = Any


def text_config(model: Any) -> ModelConfig:
    """The language part of ``model.config`` (``get_text_config()`` of a multimodal config), or the config itself
    when it has no such method."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


FULL, SLIDING = "full", "sliding"


@dataclass(frozen=True)
class KVLayout:
    """The model's attention layout, read from its config (never from the engine config).

    A *page* holds ``page_size`` tokens of K and V for one layer. A full-attention block is one page per full layer,
    a sliding block one page per sliding layer. The pool's unit, the *chunk*, is ``lcm(#full, #sliding)`` pages,
    so whole full blocks and whole sliding blocks both tile it: block ``b`` of a group with ``n`` layers owns pages
    ``b * n .. b * n + n - 1``, and layer ``i`` of the group uses page ``b * n + i``.

    Attributes:
        layer_types: per layer, FULL or SLIDING.
        sliding_window: tokens a sliding layer attends to (itself included); None when no layer slides.
    """

    layer_types: tuple[str, ...]
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("a sliding-window layer needs a positive sliding_window")

    @classmethod
    def from_model_config(cls, config: ModelConfig) -> "KVLayout":
        """Layer types from ``config.layer_types`` ("full_attention" / "sliding_attention"); else every layer
        slides when ``config.sliding_window`` is set (Mistral) and attends fully otherwise."""
        num_layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            types = tuple(SLIDING if "sliding" in str(t) else FULL for t in layer_types[:num_layers])
        elif window and getattr(config, "use_sliding_window", True):
            types = (SLIDING,) * num_layers
        else:
            types = (FULL,) * num_layers
        return cls(types, window if SLIDING in types else None)

    @classmethod
    def full(cls, num_layers: int) -> "KVLayout":
        return cls((FULL,) * num_layers)

    def num_layers_of(self, kind: str) -> int:
        return sum(1 for t in self.layer_types if t == kind)

    @cached_property  # read every step (the engine zeroes pages per chunk); the layout never changes
    def chunk_pages(self) -> int:
        counts = [n for n in (self.num_layers_of(FULL), self.num_layers_of(SLIDING)) if n]
        return math.lcm(*counts)

    def index_in_group(self, layer: int) -> int:
        """Position of ``layer`` among the layers of its own kind."""
        kind = self.layer_types[layer]
        return sum(1 for t in self.layer_types[:layer] if t == kind)
