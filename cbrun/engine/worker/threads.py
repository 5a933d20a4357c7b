"""The CPU thread count of ``engine.num_threads = "auto"``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger("cbrun.engine")

#: Models with fewer parameters than this run on one thread: their matmuls are too small for OpenMP's fork/join
#: per op to pay, and on a shared machine extra threads only wait on each other (stories260K: ~4x slower at torch's
#: default thread count than at 1). At 40M parameters (bench workload random-llama-30m) the matmuls dominate and
#: more cores help.
TINY_MODEL_PARAMS = 10_000_000


def physical_cores() -> int:
    """CPU cores this process may run on, counting hyperthread siblings once.

    Reads the (package, core) pair of every CPU in the affinity mask from ``/sys/devices/system/cpu``; where that is
    unreadable, counts logical CPUs.
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def resolve_attention_threads(setting: int | str | None, device: str) -> int | None:
    """Threads of the C attention kernel (``cbrun.kernels.cpu_attention``), or None to use torch's intra-op count.

    Rule for "auto" on the CPU: every physical core, even where torch keeps one thread for a tiny model. The kernel
    forks once per layer call over hundreds of independent (request, head) items, so unlike torch's per-op
    fork/join on tiny matmuls it scales: attention is most of a small model's step.

    Args:
        setting: ``EngineConfig.num_threads``; an explicit count (or None) applies to the kernel as to torch.
        device: the engine's device string.
    """
    if setting != "auto" or torch.device(device).type != "cpu":
        return None
    return physical_cores()


def resolve_num_threads(setting: int | str | None, num_params: int, device: str) -> int | None:
    """The intra-op thread count to set for ``engine.num_threads``, or None to leave torch's as it is.

    Rule for "auto": on the CPU, a model under ``TINY_MODEL_PARAMS`` parameters gets 1 thread and a larger one every
    physical core (``physical_cores``); on an accelerator the host only launches work, so torch's default is kept.

    Args:
        setting: ``EngineConfig.num_threads``: a positive int, "auto", or None (keep torch's).
        num_params: the model's parameter count.
        device: the engine's device string.
    """
    if setting != "auto":
        assert not isinstance(setting, str), f"num_threads {setting!r}"  # EngineConfig allows only "auto"
        return setting
    if torch.device(device).type != "cpu":
        return None
    threads = 1 if num_params < TINY_MODEL_PARAMS else physical_cores()
    logger.info(
        "num_threads auto: %d (%.1fM parameters, %d physical cores)", threads, num_params / 1e6, physical_cores()
    )
    return threads
