"""How many KV-cache blocks to allocate."""

from __future__ import annotations

import logging

import torch

from engine.cache_spec import cdiv
from engine.config import EngineConfig

logger = logging.getLogger("cbrun.engine")

#: Activation bytes per batch token, in hidden-size units of float32: residual, norms, q/k/v/o, MLP (3 x
#: intermediate is folded in separately). A deliberate overestimate; it only has to keep the forward pass from
#: running out of what the cache left.
_ACTIVATION_HIDDEN_MULTIPLE = 8


def available_memory_bytes(device: str) -> int:
    """Free memory of the device in bytes: ``torch.cuda.mem_get_info`` on CUDA, MemAvailable on the CPU.

    Raises:
        OSError: when /proc/meminfo cannot be read on a CPU device.
    """
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("cannot read MemAvailable from /proc/meminfo")


def step_workspace_bytes(config: EngineConfig, model_config) -> int:
    """Memory one forward pass needs besides the cache: activations for ``max_batch_tokens``, float32 logits for
    ``max_requests_per_batch`` rows, and the index tensors (input ids, positions, slot mapping, block tables)."""
    hidden = model_config.hidden_size
    intermediate = getattr(model_config, "intermediate_size", None) or 4 * hidden
    activations = config.max_batch_tokens * (_ACTIVATION_HIDDEN_MULTIPLE * hidden + 3 * intermediate) * 4
    logits = config.max_requests_per_batch * model_config.vocab_size * 4
    indices = config.max_batch_tokens * 8 * 4 + config.max_requests_per_batch * 8 * 4
    return activations + logits + indices


def resolve_num_blocks(config: EngineConfig, max_model_len: int, bytes_per_block: int, model_config) -> int:
    """The block pool's size.

    ``config.num_blocks`` when set. Otherwise what fits in ``max_memory_percent`` of free memory (measured after
    the model is loaded) once a forward pass's workspace is set aside, and never more than every request slot
    (``max_requests_per_batch``) growing to ``max_model_len`` could use.

    Raises:
        ValueError: when the memory budget cannot hold even one block.
    """
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        free = available_memory_bytes(config.device)
        budget = int(free * config.max_memory_percent) - step_workspace_bytes(config, model_config)
        if budget < bytes_per_block:
            raise ValueError(f"max_memory_percent={config.max_memory_percent} of {free / 2**30:.2f} GiB free "
                             f"leaves no room for a KV-cache block of {bytes_per_block} bytes; raise it, lower "
                             f"max_batch_tokens, or set engine.num_blocks")
        useful = config.max_requests_per_batch * cdiv(max_model_len, config.page_size)
        num_blocks = min(budget // bytes_per_block, useful)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens of capacity, %.1f MiB", num_blocks, config.page_size,
                num_blocks * config.page_size, num_blocks * bytes_per_block / 2**20)
    return num_blocks
