"""The CPU engine's weights on transparent huge pages (2 MiB), so a decode step streams them at the memory's speed.

A decode step reads every weight it needs once, and on the CPU its time is mostly that read. With 4 KiB pages the
hardware prefetcher stops at every page boundary and every 4 KiB costs a TLB walk; 2 MiB pages remove both (on an
AMD EPYC Zen 4, summing a random Qwen3-MoE layer's experts went from 15.5 to 25 GB/s, the C MoE kernel from 3.09 to
2.08 ms a layer at 16 rows). Where the kernel's ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (a
common default), memory gets huge pages only where a program asks with ``madvise(MADV_HUGEPAGE)`` before touching
it, and PyTorch's CPU allocator does not ask (unless ``THP_MEM_ALLOC_ENABLE=1`` is set before torch starts: a
process-wide switch library users do not have). So the loader places the weights itself: ``place_on_huge_pages``
reserves one fresh anonymous mapping for all the large weights (never touched yet), advises it, and copies the
weights in one at a time, each tensor rebound in place (``Tensor.set_``) to its copy, so every holder of the tensor
sees the new memory and the old copy is freed before the next one is made: the load holds at most one weight twice.

``always`` needs none of this (the kernel backs large allocations with huge pages already); ``never``, a kernel
without transparent huge pages, or a failing ``madvise`` leave the weights where they are, said once at INFO.
``CBRUN_HUGE_PAGES=0`` in the environment turns the move off (for A/B measurements: ``benchmarks/moe_lean.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("cbrun.engine")

#: The huge page size on x86-64 and arm64 (4 KiB base pages) Linux.
HUGE_PAGE = 2 << 20
#: Weights at least this large are moved: the projections, experts and routers a step streams; the norms and
#: biases below it are a few pages each. Measured (Zen 4, one thread, ``torch.sum`` over 64 MiB of float32 tensors
#: of one size, 4 KiB pages against the arena): 64 KiB tensors 11.9 -> 15.9 GB/s, 256 KiB 14.6 -> 26.2, 1 MiB
#: 16.0 -> 27.8, 4 MiB 17.6 -> 30.5. The arena packs them with no per-tensor padding, so a move costs a copy at load
#: and no memory.
MIN_BYTES = 64 << 10
#: Each weight starts on a cache line in the arena (torch's own CPU allocations are 64-byte aligned, so the
#: kernels' alignment needs (16-byte rows for the C MoE kernel and ``torch._grouped_mm``) hold as before).
ALIGNMENT = 64
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: "0" turns the move off (read by ``unavailable_reason`` only).
OFF_SWITCH = "CBRUN_HUGE_PAGES"
#: Linux's ``madvise`` advice that reclaims pages now, their contents kept (file pages dropped, refaulted from the
#: file if read again; private changes swapped): residency changes, never the memory's meaning.
MADV_PAGEOUT = 21
PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class Placement:
    """What ``place_on_huge_pages`` did: ``moved`` tensors of ``nbytes`` bytes in all, in the arena starting at
    ``address`` (0 when none moved); ``reason``: why none were moved, None when some were (or none qualified)."""

    moved: int
    nbytes: int
    address: int
    reason: str | None


def thp_mode(path: Path | None = None) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), None where it has none to read.
    ``path``: the file to read, ``THP_ENABLED`` by default."""
    try:
        text = (path or THP_ENABLED).read_text(encoding="ascii")
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def unavailable_reason(mode: str | None = None) -> str | None:
    """Why the weights are not moved to madvised huge pages here (None: they are). ``mode``: the THP mode, read
    from the kernel (``thp_mode``) when None."""
    if os.environ.get(OFF_SWITCH) == "0":
        return f"{OFF_SWITCH}=0 in the environment"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"transparent huge pages are a Linux feature, and this is {sys.platform}"
    mode = thp_mode() if mode is None else mode
    if mode is None:
        return f"the kernel has no transparent huge pages ({THP_ENABLED} is unreadable)"
    if mode == "never":
        return f"transparent huge pages are off ({THP_ENABLED} is 'never')"
    if mode == "always":
        return f"not needed: {THP_ENABLED} is 'always', so the kernel backs large allocations with huge pages already"
    return None


def place_on_huge_pages(tensors: Iterable[torch.Tensor], mode: str | None = None) -> Placement:
    """Move each large CPU tensor of ``tensors`` into one arena advised ``MADV_HUGEPAGE``, in place.

    A tensor moves when it is on the CPU, contiguous, at least ``MIN_BYTES``, and the only view of its storage
    (offset 0, the storage's whole length: a view of a larger tensor would keep the old storage alive, two copies).
    Each moved tensor keeps its values (bit for bit), dtype, shape and strides; its storage becomes a 64-byte
    aligned part of the arena, which lives as long as any moved tensor does. Call it before anything takes views
    of the weights (the forward pass's structures).

    Args:
        tensors: the model's weights (``parameters()``), each once.
        mode: the THP mode; None reads the kernel's (``thp_mode``).

    Returns:
        what was moved, or why nothing was (logged once at INFO).
    """
    movable = [t for t in tensors if _movable(t)]
    if not movable:
        return Placement(0, 0, 0, None)
    reason = unavailable_reason(mode)
    if reason is None:
        offsets, total = _layout(movable)
        try:
            arena = _advised_arena(total)
        except OSError as exc:
            reason = f"madvise(MADV_HUGEPAGE) failed ({exc})"
    if reason is not None:
        _log_once(f"weights on huge pages: no, {reason}")
        return Placement(0, 0, 0, reason)
    with torch.no_grad(), releasing_old_copies() as release:
        for tensor, offset in zip(movable, offsets):
            old = (tensor.data_ptr(), tensor.nbytes)
            _move(tensor, arena, offset)
            release(*old)
    logger.info("weights on huge pages: %d tensors, %.1f MiB", len(movable), total / 2**20)
    return Placement(len(movable), total, arena.data_ptr(), None)


@contextlib.contextmanager
def releasing_old_copies() -> Iterator[Callable[[int, int], None]]:
    """Yields ``release(address, nbytes)``, to call on a weight's old copy as soon as it was copied elsewhere, so
    that a load holds one weight twice at most: the old copy's whole pages in a file mapping are reclaimed at once
    (``MADV_PAGEOUT``: safetensors' mapping stays while any tensor of its file lives, so its pages would count as
    this process's memory), and at exit the heap is trimmed of the old copies freed into it. Best effort: a failure
    costs memory, never a value."""
    files = _file_mappings()

    def release(address: int, nbytes: int) -> None:
        if any(start <= address < end for start, end in files):
            _page_out(address, nbytes)

    try:
        yield release
    finally:
        _trim_heap()


def _movable(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.nbytes >= MIN_BYTES
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
    )


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the arena, in order, each ``ALIGNMENT``-aligned; and the arena's length."""
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end = -(-(end + tensor.nbytes) // ALIGNMENT) * ALIGNMENT
    return offsets, end


def _advised_arena(nbytes: int) -> torch.Tensor:
    """(nbytes,) uint8 of a fresh anonymous mapping, its start on a huge page, advised ``MADV_HUGEPAGE`` before
    any page of it is touched.

    Raises:
        OSError: the mapping or the advice failed.
    """
    # NOTE: Python's mmap, not torch.empty: the allocator may hand back heap pages touched before, which the advice
    # would not turn into huge pages. The extra huge page of address space aligns the start; the tensor keeps the
    # mapping alive (``torch.frombuffer`` holds its buffer), untouched pages cost no memory.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def _move(tensor: torch.Tensor, arena: torch.Tensor, offset: int) -> None:
    """Copy ``tensor`` to ``arena[offset:]`` and rebind it there in place (its old storage freed if unshared)."""
    copy = arena[offset : offset + tensor.nbytes].view(tensor.dtype)
    copy.copy_(tensor.reshape(-1))
    element = (arena.storage_offset() + offset) // tensor.element_size()
    tensor.set_(arena.untyped_storage(), element, tensor.shape, tensor.stride())


def _file_mappings() -> list[tuple[int, int]]:
    """[start, end) of each file-backed mapping of this process (/proc/self/maps; none where it is unreadable).

    safetensors hands out tensors that are views of the file's private mapping, which stays mapped while any tensor
    of the file lives: the pages a move read would count as this process's memory until the last one moved."""
    ranges = []
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        pass
    return ranges


def _page_out(address: int, nbytes: int) -> None:
    """Reclaim the whole pages of [address, address + nbytes) (``MADV_PAGEOUT``): a moved weight's old copy in a
    file mapping, so the load holds one weight twice at most, not a whole file. Best effort (kernels before 5.4
    refuse the advice): a failure costs memory, never a value."""
    libc = _libc()
    start, end = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
    if libc is not None and end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(MADV_PAGEOUT))


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def _trim_heap() -> None:
    """Hand the heap's freed pages back to the kernel (glibc's ``malloc_trim``): the old copies of weights smaller
    than malloc's mmap threshold were freed into the heap, where they would still count as the process's memory."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logger.info(message)
