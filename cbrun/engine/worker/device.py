"""Which CUDA device the engine's work lands on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def select_device(device: str) -> None:
    """Make ``device`` the process's current CUDA device when it is one ("cuda:1"); nothing otherwise.

    Streams, events and graph pools created without a device, ``torch.cuda.synchronize()``, and every Triton
    launch (Triton reads torch's current device) use the current device, so setting it once, before the engine
    allocates anything, puts all of them on ``device``. "cuda" alone keeps the current device.

    Raises:
        ValueError: when ``device`` names a CUDA index this machine does not have.
    """
    target = torch.device(device)
    if target.type != "cuda" or target.index is None:
        return
    count = torch.cuda.device_count()
    if target.index >= count:
        raise ValueError(f"device {device!r}: this machine has {count} CUDA device(s)")
    torch.cuda.set_device(target)


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of host ``values`` (a list, or nested lists) on ``device``, without making the host wait.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory and synchronises the stream: called after a
    forward pass is enqueued (the sampler at launch), the host would wait for that pass, and async batching would
    lose its overlap. On CUDA the values go through page-locked memory with a non-blocking copy instead (the
    caching host allocator keeps the buffer until the copy ran); elsewhere it is ``torch.tensor``.
    """
    target = torch.device(device)
    if target.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=target)
    return torch.tensor(values, dtype=dtype).pin_memory().to(target, non_blocking=True)


def waits_for_device(device: torch.device) -> bool:
    """Whether reading a device value on the host (``bool(t.any())``) makes the host wait for queued work: true on
    any accelerator, false on the CPU, where ops run when called. Code on the step's path skips such reads there
    (branch-free ops instead); on the CPU the read is free and skipping work is worth it."""
    return device.type != "cpu"
