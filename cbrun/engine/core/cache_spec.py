"""The KV cache's geometry, fixed at engine start, and the one rule that turns a block into page and slot addresses.

Every part that addresses the cache (block manager, KV-cache tensors, padding policy, model runner, attention)
reads its numbers from one ``CacheSpec``. Address rule (see ``KVLayout`` for chunks and groups)::

    page(block, layer i of its group) = block * layers_per_block + i        (layers_per_block: the group's layers)
    slot(page, offset)                = page * page_size + offset           (flat index into (num_pages, page_size))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from cbrun.engine.core.kv_layout import SLIDING, KVLayout

if TYPE_CHECKING:
    import numpy as np
    import torch

#: An int, an integer tensor or an integer array: the address rule is the same arithmetic on each.
Index = TypeVar("Index", int, "torch.Tensor", "np.ndarray")

#: Chunks 0 and 1 are never given to a request: padded reads and writes (CUDA graphs) may land there.
NUM_RESERVED_CHUNKS = 2


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


def page_address(block: Index, layers_per_block: int, layer: int = 0) -> Index:
    """Page of ``layer`` (index within its group) of ``block``; ``block`` may be an int or an integer tensor."""
    return block * layers_per_block + layer


def slot_address(page: Index, offset: Index | int, page_size: int) -> Index:
    """Flat cache slot of token ``offset`` of ``page``; ints or integer tensors."""
    return page * page_size + offset


@dataclass(frozen=True)
class CacheSpec:
    """Where the KV cache's pages are and how many there are; built once, shared read-only.

    Attributes:
        page_size: tokens per page (and per block).
        layout: the model's full / sliding layers (which decides the chunk size and the pages per block).
        num_chunks: pool chunks, the ``NUM_RESERVED_CHUNKS`` padding chunks included.
        ring_blocks: sliding-window blocks per request (0 without sliding layers).
        num_cpu_pages: pages of the CPU swap buffer (0: no offloading, preemption is a soft reset).
    """

    page_size: int
    layout: KVLayout
    num_chunks: int
    ring_blocks: int = 0
    num_cpu_pages: int = 0

    @classmethod
    def build(
        cls,
        num_blocks: int,
        page_size: int,
        layout: KVLayout | None = None,
        num_cpu_blocks: int = 0,
        max_chunk_tokens: int = 1,
        max_model_len: int | None = None,
    ) -> "CacheSpec":
        """The geometry of a pool of ``num_blocks`` blocks.

        Args:
            num_blocks: capacity in blocks of ``page_size`` tokens of every layer (rounded down to whole chunks,
                at least one; the reserved padding chunks come on top).
            page_size: tokens per block.
            layout: which layers are full and sliding; default one full layer.
            num_cpu_blocks: CPU swap capacity in blocks of every layer.
            max_chunk_tokens: most tokens a request computes in one step (sizes the sliding ring).
            max_model_len: the model's maximum length (caps the sliding ring).
        """
        layout = layout or KVLayout.full(1)
        num_layers = len(layout.layer_types)
        usable_chunks = max(1, num_blocks * num_layers // layout.chunk_pages)
        ring_blocks = 0
        if layout.num_layers_of(SLIDING):
            assert layout.sliding_window is not None  # KVLayout refuses sliding layers without a window
            # Every position a step's queries may see, [start - window + 1, start + chunk), needs its own ring slot.
            ring_blocks = cdiv(layout.sliding_window - 1 + max_chunk_tokens, page_size) + 1
            if max_model_len:
                ring_blocks = min(ring_blocks, cdiv(max_model_len, page_size))
        return cls(page_size, layout, usable_chunks + NUM_RESERVED_CHUNKS, ring_blocks, num_cpu_blocks * num_layers)

    @property
    def chunk_pages(self) -> int:
        return self.layout.chunk_pages

    @property
    def num_pages(self) -> int:
        """Device pages, the reserved padding chunks' included."""
        return self.num_chunks * self.chunk_pages

    def layers_per_block(self, kind: str) -> int:
        """Pages per block of the ``kind`` (FULL or SLIDING) allocator: its number of layers."""
        return self.layout.num_layers_of(kind)

    def pages_of(self, blocks: list[int], kind: str) -> list[int]:
        """Every page of ``blocks`` of the ``kind`` allocator, block by block, layer by layer."""
        n = self.layers_per_block(kind)
        return [page_address(b, n, i) for b in blocks for i in range(n)]
