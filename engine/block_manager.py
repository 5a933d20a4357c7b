"""The paged KV cache's block manager: free blocks, reference counts, block tables and the prefix cache."""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Callable

import numpy as np

from engine.offload import CpuSwapPool
from engine.request import Request

#: hash(parent_hash, token ids of the block) -> bytes. Tests may inject a weak one to force collisions.
BlockHashFn = Callable[[bytes, tuple[int, ...]], bytes]

ROOT_HASH = hashlib.sha256(b"cbrun-prefix-cache-root").digest()


def sha256_block_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """Chained content hash of one full block (vLLM ``hash_block_tokens``): stable across processes."""
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Owns the block pool: which blocks are free, who references each, and which hold a known prefix.

    Every request's ``block_table`` is appended to and cleared here only. A block is in exactly one state::

        never used   --allocate-->  in use (ref_count >= 1)  --last free-->  cached (ref 0, hash kept)
             ^                        ^                                          |
             |                        +------ prefix cache hit (ref + 1) --------+
             +--------------- (hash-less blocks go back here) ----- evicted: oldest cached block reused

    Prefix caching (vLLM automatic prefix caching): each full block gets ``hash(parent hash, token ids)``; a new
    request takes its longest run of cached full blocks instead of computing them. The cache is best effort: a
    cached block counts as free, so caching never makes an allocation fail.

    Args:
        num_blocks: blocks in the pool.
        page_size: tokens per block.
        enable_prefix_caching: share full blocks between requests with equal prefixes.
        hash_fn: block hash function (``sha256_block_hash`` unless a test injects another).
        num_cpu_blocks: CPU swap slots for offloaded requests (0: no swap, preemption is a soft reset).
    """

    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool = True,
                 hash_fn: BlockHashFn = sha256_block_hash, num_cpu_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.ref_counts = [0] * num_blocks
        self._never_used: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # ref 0 with a hash, least recently freed first
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._request_hashes: dict[int, list[bytes]] = {}  # id(request) -> hashes of its registered full blocks
        self.num_evicted_blocks = 0
        self.swap_pool = CpuSwapPool(num_cpu_blocks)

    # ---- capacity -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never used plus cached-but-unreferenced."""
        return len(self._never_used) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        """Blocks to add so positions up to ``num_computed_tokens + num_new_tokens`` have a slot."""
        num_slots = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(num_slots, self.page_size) - len(request.block_table) - num_cached_blocks)

    # ---- prefix cache lookup ----------------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Longest run of cached full blocks matching the request's leading tokens.

        The last prompt token is never served from cache, so a step always computes it and has logits to sample.

        Returns:
            Block ids, in position order (empty when prefix caching is off or nothing matches).
        """
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return []
        max_blocks = (request.num_tokens - 1) // self.page_size
        if request.sampling_params.prompt_logprobs_from is not None:  # its logits must be computed
            max_blocks = min(max_blocks, (request.sampling_params.prompt_logprobs_from - 1) // self.page_size)
        parent, blocks = ROOT_HASH, []
        for i in range(max_blocks):
            tokens = tuple(request.token_ids(i * self.page_size, (i + 1) * self.page_size))
            parent = self.hash_fn(parent, tokens)
            block = self._hash_to_block.get(parent)
            # A hash hit must also match the tokens: a collision can never serve another prompt's cache.
            if block is None or self._block_tokens[block] != tokens:
                break
            blocks.append(block)
        return blocks

    # ---- allocation -----------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give the request slots for ``num_new_tokens`` more tokens, taking ``cached_blocks`` first.

        All or nothing: on a shortage nothing changes and False is returned; the scheduler decides what to do.
        Full blocks that this step fills are registered in the prefix cache at once, so a request scheduled later
        in the same step can share them (every layer writes a step's KV before any attention reads it).

        Args:
            request: the request; ``cached_blocks`` may be given only before its first allocation.
            num_new_tokens: tokens scheduled this step, beyond ``num_cached_blocks * page_size`` cached ones.
            cached_blocks: from ``find_cached_prefix``.

        Returns:
            True when the slots are reserved.
        """
        needed = self.num_blocks_needed(request, num_new_tokens + len(cached_blocks) * self.page_size,
                                        len(cached_blocks))
        reviving = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if needed > self.num_free_blocks - reviving:
            return False
        for block in cached_blocks:
            if self.ref_counts[block] == 0:
                del self._cached_free[block]
            self.ref_counts[block] += 1
            request.block_table.append(block)
        if cached_blocks:
            self._request_hashes[id(request)] = [self._block_hash[b] for b in cached_blocks]
        for _ in range(needed):
            request.block_table.append(self._take_free_block())
        if self.enable_prefix_caching:
            num_tokens_after = request.num_computed_tokens + len(cached_blocks) * self.page_size + num_new_tokens
            self._register_full_blocks(request, num_tokens_after)
        return True

    def _take_free_block(self) -> int:
        if self._never_used:
            block = self._never_used.popleft()
        else:
            block, _ = self._cached_free.popitem(last=False)
            self._drop_hash(block)
            self.num_evicted_blocks += 1
        self.ref_counts[block] = 1
        return block

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        hashes = self._request_hashes.setdefault(id(request), [])
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_tokens // self.page_size):
            tokens = tuple(request.token_ids(i * self.page_size, (i + 1) * self.page_size))
            parent = self.hash_fn(parent, tokens)
            hashes.append(parent)
            block = request.block_table[i]
            # The first block to hold a content keeps the entry; a duplicate stays unhashed.
            if parent not in self._hash_to_block and self._block_hash[block] is None:
                self._hash_to_block[parent] = block
                self._block_hash[block] = parent
                self._block_tokens[block] = tokens

    def _drop_hash(self, block: int) -> None:
        block_hash = self._block_hash[block]
        if block_hash is not None and self._hash_to_block.get(block_hash) == block:
            del self._hash_to_block[block_hash]
        self._block_hash[block] = None
        self._block_tokens[block] = None

    # ---- release ----------------------------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Drop the request's references. Tail blocks are released first so the deepest ones are evicted first."""
        for block in reversed(request.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                if self._block_hash[block] is not None:
                    self._cached_free[block] = None
                else:
                    self._never_used.append(block)
        request.block_table.clear()
        self._request_hashes.pop(id(request), None)

    # ---- offloading to CPU swap ------------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to CPU slots and free them on the device.

        Returns:
            ``(device_block, cpu_slot)`` copies the model runner must make before this step's forward pass
            writes anything, or None (nothing changed) when the swap pool lacks room.
        """
        slots = self.swap_pool.allocate(len(request.block_table))
        if slots is None:
            return None
        copies = list(zip(request.block_table, slots))
        self.free(request)
        request.cpu_blocks = slots
        return copies

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Give a swapped-out request device blocks again, for its cached tokens plus ``num_new_tokens``.

        Returns:
            ``(cpu_slot, device_block)`` copies to make before the forward pass, or None when blocks lack.
            The CPU slots stay taken until ``release_swap_slots`` runs after the copy.
        """
        if not self.allocate_slots(request, num_new_tokens):
            return None
        return list(zip(request.cpu_blocks, request.block_table))

    def release_swap_slots(self, request: Request) -> None:
        self.swap_pool.free(request.cpu_blocks)
        request.cpu_blocks = []

    def check_consistency(self) -> None:
        """Assert the pool's invariants (for tests): every block is in exactly one state."""
        in_use = sum(1 for r in self.ref_counts if r > 0)
        assert in_use + len(self._never_used) + len(self._cached_free) == self.num_blocks
        assert all(self.ref_counts[b] == 0 for b in self._never_used)
        assert all(self.ref_counts[b] == 0 and self._block_hash[b] is not None for b in self._cached_free)
        assert len(set(self._never_used)) == len(self._never_used)
