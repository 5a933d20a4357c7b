"""The shared pool of KV-cache chunks, and the allocators that carve blocks out of them."""

from __future__ import annotations

from collections import deque

from cbrun.engine.core.cache_spec import NUM_RESERVED_CHUNKS, cdiv


class CachePool:
    """Owns which chunks are free. Every allocator takes whole chunks from here and returns them when empty.

    Args:
        num_chunks: chunks in the pool, the reserved ones included.
    """

    def __init__(self, num_chunks: int) -> None:
        if num_chunks <= NUM_RESERVED_CHUNKS:
            raise ValueError(f"the KV-cache pool needs more than {NUM_RESERVED_CHUNKS} chunks, got {num_chunks}")
        self.num_chunks = num_chunks
        #: Chunks below this index have been handed out at least once (the reserved ones count as used): the KV
        #: cache zeroes their pages before a step first reads them and leaves the rest of the pool untouched.
        self.num_touched_chunks = NUM_RESERVED_CHUNKS
        # A stack: the lowest chunks are handed out first, then the most recently freed ones (see ``take``).
        self._free: deque[int] = deque(range(num_chunks - 1, NUM_RESERVED_CHUNKS - 1, -1))

    @property
    def num_usable_chunks(self) -> int:
        return self.num_chunks - NUM_RESERVED_CHUNKS

    @property
    def num_free_chunks(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        # Most recently freed first: a compact working set stays in the CPU caches.
        if not self._free:
            return None
        chunk = self._free.pop()
        self.num_touched_chunks = max(self.num_touched_chunks, chunk + 1)
        return chunk

    def give_back(self, chunk: int) -> None:
        assert chunk >= NUM_RESERVED_CHUNKS, "a reserved padding chunk was freed"
        self._free.append(chunk)


class ChunkAllocator:
    """Carves blocks of ``block_pages`` pages out of pool chunks (block ``b`` lives in chunk ``b // per_chunk``).

    A chunk goes back to the pool as soon as none of its blocks is in use, so the other allocator can take it.

    Args:
        pool: the shared pool.
        chunk_pages: pages per chunk.
        block_pages: pages per block (the number of layers of this allocator's kind).
    """

    def __init__(self, pool: CachePool, chunk_pages: int, block_pages: int) -> None:
        assert chunk_pages % block_pages == 0
        self.pool = pool
        self.blocks_per_chunk = chunk_pages // block_pages
        self._free: deque[int] = deque()
        self._used_in_chunk: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks obtainable now: free ones in held chunks plus every free chunk's worth."""
        return len(self._free) + self.pool.num_free_chunks * self.blocks_per_chunk

    @property
    def num_held_free_blocks(self) -> int:
        """Free blocks inside chunks this allocator already holds."""
        return len(self._free)

    def blocks_from_chunks(self, num_blocks: int) -> int:
        """Pool chunks needed to get ``num_blocks`` blocks beyond those free in held chunks."""
        missing = max(0, num_blocks - len(self._free))
        return cdiv(missing, self.blocks_per_chunk)

    def take(self) -> int | None:
        if not self._free:
            chunk = self.pool.take()
            if chunk is None:
                return None
            first = chunk * self.blocks_per_chunk
            self._free.extend(range(first, first + self.blocks_per_chunk))
            self._used_in_chunk[chunk] = 0
        block = self._free.popleft()
        self._used_in_chunk[block // self.blocks_per_chunk] += 1
        return block

    def release(self, block: int) -> None:
        chunk = block // self.blocks_per_chunk
        self._used_in_chunk[chunk] -= 1
        self._free.append(block)
        if self._used_in_chunk[chunk] == 0:
            del self._used_in_chunk[chunk]
            first = chunk * self.blocks_per_chunk
            self._free = deque(b for b in self._free if not first <= b < first + self.blocks_per_chunk)
            self.pool.give_back(chunk)

    @property
    def num_held_chunks(self) -> int:
        return len(self._used_in_chunk)
