"""How many KV-cache blocks to allocate."""

from __future__ import annotations

import logging

import torch

from engine.block_manager import cdiv
from engine.config import EngineConfig

logger = logging.getLogger("cbrun.engine")


def available_memory_bytes(device: str) -> int:
    """Free memory of the device: ``torch.cuda.mem_get_info`` on CUDA, MemAvailable from /proc/meminfo on CPU."""
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("cannot read MemAvailable from /proc/meminfo")


def resolve_num_blocks(config: EngineConfig, max_model_len: int, bytes_per_block: int) -> int:
    """The block pool's size: ``config.num_blocks`` if set, else what ``max_memory_percent`` of free memory holds.

    Never more than every request slot (``max_requests_per_batch``) growing to ``max_model_len`` could use.
    """
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        budget = int(available_memory_bytes(config.device) * config.max_memory_percent)
        useful = config.max_requests_per_batch * cdiv(max_model_len, config.page_size)
        num_blocks = max(1, min(budget // bytes_per_block, useful))
    logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB", num_blocks, config.page_size,
                num_blocks * config.page_size, num_blocks * bytes_per_block / 2**20)
    return num_blocks
