"""CPU swap space for offloaded requests: which pages of the CPU swap buffer are free."""

from __future__ import annotations


class CpuSwapPool:
    """Bookkeeping of the pre-allocated CPU swap buffer (the tensors live in ``KVCache``).

    Args:
        num_slots: pages the buffer holds (``CacheSpec.num_cpu_pages``: ``cpu_offload_space`` GiB over the bytes
            of one layer's page); 0 disables swap.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` slots, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))
        assert len(self._free) <= self.num_slots, "swap slot freed twice"
