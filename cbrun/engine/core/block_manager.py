"""The KV-cache manager: block tables, reference counts, the prefix cache and offloading, over a shared pool."""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from cbrun.engine.core.cache_pool import CachePool, ChunkAllocator
from cbrun.engine.core.cache_spec import NUM_RESERVED_CHUNKS, CacheSpec, cdiv
from cbrun.engine.core.kv_layout import FULL, SLIDING
from cbrun.engine.core.offload import CpuSwapPool
from cbrun.engine.core.request import Request

logger = logging.getLogger("cbrun.engine")

#: hash(parent_hash, token ids of the block) -> bytes. Tests may inject a weak one to force collisions.
BlockHashFn = Callable[[bytes, tuple[int, ...]], bytes]

ROOT_HASH = hashlib.sha256(b"cbrun-prefix-cache-root").digest()
#: The chain link of a request's first block: the serial of the (virtual) block before position 0.
ROOT_SERIAL = 0


def sha256_block_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """Chained content hash of one full block (vLLM ``hash_block_tokens``): stable across processes."""
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


def truncated_block_hash(bits: int) -> BlockHashFn:
    """``sha256_block_hash`` cut to its first ``bits`` bits (a multiple of 8): a weak hash that makes tests collide.

    Raises:
        ValueError: when ``bits`` is not a multiple of 8 in [8, 256].
    """
    if bits % 8 or not 8 <= bits <= 256:
        raise ValueError(f"prefix_hash_bits must be a multiple of 8 in [8, 256], got {bits!r}")
    if bits == 256:
        return sha256_block_hash
    num_bytes = bits // 8
    return lambda parent, token_ids: sha256_block_hash(parent, token_ids)[:num_bytes]


class BlockManager:
    """Owns the KV cache's bookkeeping: free blocks, block tables, reference counts, the prefix cache, swap slots.

    One ``CachePool`` of chunks serves a full-attention allocator (``request.block_table``: one block per
    ``page_size`` tokens, grows with the sequence) and a sliding-window allocator (``request.sliding_block_table``:
    a ring of ``ring_blocks`` blocks recycled as the window moves), whichever the model's layers need. A request is
    admitted only when every allocator has room; otherwise nothing is reserved.

    Full blocks move through these states (prefix caching, vLLM-style)::

        free   --allocate-->  in use (ref_count >= 1)  --last release-->  cached (ref 0, hash kept)
          ^                     ^                                            |
          |                     +------- prefix cache hit (ref + 1) ---------+
          +------ hash-less blocks go back to their chunk; the oldest cached block is evicted when none is free

    Each full block's content is ``hash(parent hash, token ids)``; a new request takes its longest run of cached
    blocks instead of computing them. A cached block counts as free, so caching never makes an allocation fail.
    Sharing is on only when every layer attends fully (a sliding ring cannot be shared).

    Args:
        spec: the cache's geometry (page size, layout, chunks, ring size, CPU swap pages).
        enable_prefix_caching: share full blocks between requests with equal prefixes.
        hash_fn: block hash function (``sha256_block_hash`` unless a test injects another).

    A hash hit serves a block only when the block's stored token ids equal the request's and its stored parent is
    the block served just before it (one tuple and one integer comparison per hit). Each registration gets a new
    serial number and a block keeps its parent's serial, so by induction from ``ROOT_SERIAL`` a served run holds
    exactly the request's leading tokens at their own positions, whatever the hash width. A refused hit is counted
    in ``num_hash_collisions`` and served as a miss, never as another prompt's KV.
    """

    def __init__(
        self, spec: CacheSpec, enable_prefix_caching: bool = True, hash_fn: BlockHashFn = sha256_block_hash
    ) -> None:
        self.spec = spec
        self.layout = spec.layout
        self.page_size = spec.page_size
        self.pool = CachePool(spec.num_chunks)
        num_full_layers, num_sliding_layers = spec.layers_per_block(FULL), spec.layers_per_block(SLIDING)
        self.full = ChunkAllocator(self.pool, spec.chunk_pages, num_full_layers) if num_full_layers else None
        self.sliding = ChunkAllocator(self.pool, spec.chunk_pages, num_sliding_layers) if num_sliding_layers else None
        self.ring_blocks = spec.ring_blocks
        main = self.full or self.sliding
        assert main is not None, "a layout has at least one layer"
        #: The allocator whose blocks count as the pool's (full attention, else sliding).
        self.main = main
        self.num_blocks = self.pool.num_usable_chunks * main.blocks_per_chunk
        self.enable_prefix_caching = enable_prefix_caching and self.sliding is None
        if enable_prefix_caching and self.sliding is not None:
            logger.info("prefix sharing is off: the model has sliding-window layers, whose blocks cannot be shared")
        self.hash_fn = hash_fn
        num_block_ids = self.pool.num_chunks * main.blocks_per_chunk
        self.ref_counts = [0] * num_block_ids
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # ref 0 with a hash, least recently freed first
        self._block_hash: list[bytes | None] = [None] * num_block_ids
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_block_ids
        # The chain check: a registered block's own serial and the serial of the block before it in its chain.
        self._block_serial: list[int | None] = [None] * num_block_ids
        self._block_parent: list[int | None] = [None] * num_block_ids
        self._next_serial = ROOT_SERIAL + 1
        self._hash_to_block: dict[bytes, int] = {}
        self._request_hashes: dict[int, list[bytes]] = {}  # Request.index -> hashes of its registered full blocks
        # Request.index -> per full block, the serial of a cached block holding the same chain (None: none does)
        self._request_serials: dict[int, list[int | None]] = {}
        self.num_evicted_blocks = 0
        self.num_hash_collisions = 0  # hash hits refused: other tokens, or another chain (served as misses)
        self.swap_pool = CpuSwapPool(spec.num_cpu_pages)

    # ---- capacity -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation of the main allocator may take now (cached-but-unreferenced ones included)."""
        return self.main.num_free_blocks + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def free_fraction(self) -> float:
        """Fraction of the usable pool that is free (cached blocks count as free)."""
        cached_chunks = len(self._cached_free) / (self.full.blocks_per_chunk if self.full else 1)
        return (self.pool.num_free_chunks + cached_chunks) / self.pool.num_usable_chunks

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        """Full blocks to add so positions up to ``num_computed_tokens + num_new_tokens`` have a slot."""
        if self.full is None:
            return 0
        num_slots = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(num_slots, self.page_size) - len(request.block_table) - num_cached_blocks)

    def _sliding_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        if self.sliding is None:
            return 0
        wanted = min(self.ring_blocks, cdiv(request.num_computed_tokens + num_new_tokens, self.page_size))
        return max(0, wanted - len(request.sliding_block_table))

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens fits the whole pool when nothing else runs."""
        blocks = cdiv(num_tokens, self.page_size)
        chunks = 0
        if self.full is not None:
            chunks += cdiv(blocks, self.full.blocks_per_chunk)
        if self.sliding is not None:
            chunks += cdiv(min(blocks, self.ring_blocks), self.sliding.blocks_per_chunk)
        return chunks <= self.pool.num_usable_chunks

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
        parent_serial: int | None = ROOT_SERIAL  # a registered block's serial is never None
        for i in range(max_blocks):
            tokens = tuple(request.token_ids(i * self.page_size, (i + 1) * self.page_size))
            parent = self.hash_fn(parent, tokens)
            block = self._hash_to_block.get(parent)
            if block is None:
                break
            # A hash hit must also match the tokens and follow the block served before it: a collision can never
            # serve another prompt's cache, nor the same tokens computed after another prefix.
            if self._block_tokens[block] != tokens or self._block_parent[block] != parent_serial:
                self.num_hash_collisions += 1
                break
            blocks.append(block)
            parent_serial = self._block_serial[block]
        return blocks

    # ---- allocation -----------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Give the request slots for ``num_new_tokens`` more tokens in every allocator, cached blocks first.

        All or nothing: on a shortage nothing changes and False is returned; the scheduler decides what to do.
        Full blocks that this step fills are registered in the prefix cache at once, so a request scheduled later
        in the same step can share them (every layer writes a step's KV before any attention reads it).

        Args:
            request: the request; ``cached_blocks`` may be given only before its first allocation.
            num_new_tokens: tokens scheduled this step, beyond ``len(cached_blocks) * page_size`` cached ones.
            cached_blocks: from ``find_cached_prefix``.

        Returns:
            True when the slots are reserved.
        """
        if not cached_blocks and self.sliding is None:
            num_slots = request.num_computed_tokens + num_new_tokens
            if num_slots <= len(request.block_table) * self.page_size:  # most decode steps: no new block
                # Blocks filled since the last registration get hashed (``_register_full_blocks``); this check
                # spares the call on the other steps.
                if self.enable_prefix_caching and num_slots // self.page_size > len(
                    self._request_hashes.get(request.index, ())
                ):
                    self._register_full_blocks(request, num_slots)
                return True
        num_cached_tokens = len(cached_blocks) * self.page_size
        full_needed = self.num_blocks_needed(request, num_new_tokens + num_cached_tokens, len(cached_blocks))
        sliding_needed = self._sliding_blocks_needed(request, num_new_tokens + num_cached_tokens)
        needs_blocks = full_needed or sliding_needed or cached_blocks
        # Most decode steps need no new block: skip the room check (this runs for every request every step).
        if needs_blocks and not self._has_room(full_needed, sliding_needed, cached_blocks):
            return False
        self._take_cached(request, cached_blocks)
        for _ in range(full_needed):
            request.block_table.append(self._take_full_block())
        if sliding_needed:
            sliding = self._sliding_allocator()
            for _ in range(sliding_needed):  # ``_has_room`` checked that the pool holds them
                block = sliding.take()
                assert block is not None
                request.sliding_block_table.append(block)
        if self.enable_prefix_caching:
            num_tokens_after = request.num_computed_tokens + num_cached_tokens + num_new_tokens
            self._register_full_blocks(request, num_tokens_after)
        return True

    def _has_room(self, full_needed: int, sliding_needed: int, cached_blocks: Sequence[int]) -> bool:
        free_chunks = self.pool.num_free_chunks
        if self.sliding is not None:
            free_chunks -= self.sliding.blocks_from_chunks(sliding_needed)
            if free_chunks < 0:
                return False
        if self.full is None:
            return True
        reviving = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        evictable = len(self._cached_free) - reviving
        missing = max(0, full_needed - self.full.num_held_free_blocks - evictable)
        return missing <= free_chunks * self.full.blocks_per_chunk

    def _take_cached(self, request: Request, cached_blocks: Sequence[int]) -> None:
        for block in cached_blocks:
            if self.ref_counts[block] == 0:
                del self._cached_free[block]
            self.ref_counts[block] += 1
            request.block_table.append(block)
        if cached_blocks:
            self._request_hashes[request.index] = [self._registered_hash(b) for b in cached_blocks]
            self._request_serials[request.index] = [self._block_serial[b] for b in cached_blocks]

    def _registered_hash(self, block: int) -> bytes:
        """The hash of a block in the prefix cache (``find_cached_prefix`` serves only those)."""
        block_hash = self._block_hash[block]
        assert block_hash is not None, f"block {block} is not in the prefix cache"
        return block_hash

    def _full_allocator(self) -> ChunkAllocator:
        """The full-attention allocator; a request holds full blocks only when the model has full layers."""
        assert self.full is not None, "the model has no full-attention layers"
        return self.full

    def _sliding_allocator(self) -> ChunkAllocator:
        """The sliding-window allocator; a request holds ring blocks only when the model has sliding layers."""
        assert self.sliding is not None, "the model has no sliding-window layers"
        return self.sliding

    def _take_full_block(self) -> int:
        block = self._full_allocator().take()
        if block is None:
            block, _ = self._cached_free.popitem(last=False)
            self._drop_hash(block)
            self.num_evicted_blocks += 1
        self.ref_counts[block] = 1
        return block

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        # A block holding a token still on the device (async batching) is hashed by a later step.
        num_full = min(num_tokens, len(request.prompt_token_ids) + len(request.output_token_ids)) // self.page_size
        hashes = self._request_hashes.get(request.index)
        if hashes is not None and len(hashes) >= num_full:
            return  # no block filled up since the last call (most decode steps)
        hashes = self._request_hashes.setdefault(request.index, [])
        serials = self._request_serials.setdefault(request.index, [])
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_full):
            tokens = tuple(request.token_ids(i * self.page_size, (i + 1) * self.page_size))
            parent = self.hash_fn(parent, tokens)
            hashes.append(parent)
            serials.append(
                self._register_block(request.block_table[i], parent, tokens, serials[i - 1] if i else ROOT_SERIAL)
            )

    def _register_block(
        self, block: int, block_hash: bytes, tokens: tuple[int, ...], parent_serial: int | None
    ) -> int | None:
        """Enter one full block in the prefix cache; returns the serial of the cached block holding its chain.

        The first block to hold a chain keeps the entry; a duplicate stays unhashed and links its successors to
        the entry. A block whose chain is not in the cache (its parent's was refused, or the hash is taken by
        another chain) is not entered, nor are the blocks after it: None.
        """
        if parent_serial is None:
            return None
        holder = self._hash_to_block.get(block_hash)
        if holder is None and self._block_hash[block] is None:
            self._hash_to_block[block_hash] = block
            self._block_hash[block] = block_hash
            self._block_tokens[block] = tokens
            self._block_serial[block] = self._next_serial
            self._block_parent[block] = parent_serial
            self._next_serial += 1
            return self._block_serial[block]
        if holder is not None and self._block_tokens[holder] == tokens and self._block_parent[holder] == parent_serial:
            return self._block_serial[holder]
        return None

    def _drop_hash(self, block: int) -> None:
        block_hash = self._block_hash[block]
        if block_hash is not None and self._hash_to_block.get(block_hash) == block:
            del self._hash_to_block[block_hash]
        self._block_hash[block] = None
        self._block_tokens[block] = None
        self._block_serial[block] = None
        self._block_parent[block] = None

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
                    self._full_allocator().release(block)
        for block in request.sliding_block_table:
            self._sliding_allocator().release(block)
        request.block_table.clear()
        request.sliding_block_table.clear()
        self._request_hashes.pop(request.index, None)
        self._request_serials.pop(request.index, None)

    def trim(self, request: Request) -> None:
        """Free the request's blocks past its computed tokens: the slots of rejected speculative proposals.

        Such full blocks hold no known token, so they were never registered in the prefix cache, nor shared. A
        sliding ring keeps the blocks it would hold without the proposals (``min(ring_blocks, blocks of the
        computed tokens)``, as ``allocate_slots`` grows it): a rejected position's ring slot lies past every
        position a later query may read before that position is written again (the ring spans the window plus
        a step's tokens, and a verify step is one of those).
        """
        keep = cdiv(request.num_computed_tokens, self.page_size)
        while self.full is not None and len(request.block_table) > keep:
            block = request.block_table.pop()
            assert self.ref_counts[block] == 1 and self._block_hash[block] is None, f"block {block} is shared"
            self.ref_counts[block] = 0
            self.full.release(block)
        while self.sliding is not None and len(request.sliding_block_table) > min(self.ring_blocks, keep):
            self.sliding.release(request.sliding_block_table.pop())

    # ---- pages, for the model runner and offloading -----------------------------------------------------------
    def request_pages(self, request: Request) -> list[int]:
        """Every page the request holds: its full blocks' pages, then its sliding ring's."""
        return self.spec.pages_of(request.block_table, FULL) + self.spec.pages_of(request.sliding_block_table, SLIDING)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's pages to CPU slots and free its blocks on the device.

        Returns:
            ``(device page, CPU slot)`` copies the model runner must make before this step's forward pass
            writes anything, or None (nothing changed) when the swap pool lacks room.
        """
        pages = self.request_pages(request)
        slots = self.swap_pool.allocate(len(pages))
        if slots is None:
            return None
        self.free(request)
        request.cpu_pages = slots
        return list(zip(pages, slots))

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Give a swapped-out request device blocks again, for its cached tokens plus ``num_new_tokens``.

        Returns:
            ``(CPU slot, device page)`` copies to make before the forward pass, or None when blocks lack.
            The request holds no CPU slots afterwards; the slots stay taken until ``free_swap_slots`` runs after
            the copies.
        """
        num_full = cdiv(request.num_computed_tokens, self.page_size) if self.full else 0
        num_ring = min(self.ring_blocks, cdiv(request.num_computed_tokens, self.page_size)) if self.sliding else 0
        if not self.allocate_slots(request, num_new_tokens):
            return None
        pages = self.spec.pages_of(request.block_table[:num_full], FULL) + self.spec.pages_of(
            request.sliding_block_table[:num_ring], SLIDING
        )
        assert len(pages) == len(request.cpu_pages)
        copies = list(zip(request.cpu_pages, pages))
        request.cpu_pages = []  # the slots stay taken until ``free_swap_slots`` runs after the copies
        return copies

    def release_swap_slots(self, request: Request) -> None:
        """Free the CPU slots of a swapped-out request that will not be swapped in (finished or aborted)."""
        self.free_swap_slots(request.cpu_pages)
        request.cpu_pages = []

    def free_swap_slots(self, slots: list[int]) -> None:
        self.swap_pool.free(slots)

    def check_consistency(self) -> None:
        """Assert the pool's invariants (for tests): chunks, blocks and references add up."""
        held = sum(a.num_held_chunks for a in (self.full, self.sliding) if a is not None)
        assert held + self.pool.num_free_chunks == self.pool.num_usable_chunks, "chunks leaked"
        assert all(self.ref_counts[b] == 0 and self._block_hash[b] is not None for b in self._cached_free)
        assert all(r >= 0 for r in self.ref_counts)
        reserved = NUM_RESERVED_CHUNKS * self.main.blocks_per_chunk
        assert all(r == 0 for r in self.ref_counts[:reserved]), "a padding chunk was handed out"
