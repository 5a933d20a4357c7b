"""Which CUDA device the engine's work lands on."""

from __future__ import annotations

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
