"""How many KV-cache blocks to allocate."""

from __future__ import annotations

import logging

import torch

from cbrun.engine.config import EngineConfig
from cbrun.engine.core.cache_spec import cdiv
from cbrun.engine.core.kv_layout import ModelConfig

logger = logging.getLogger("cbrun.engine")

#: Activation bytes per batch token, in hidden-size units of float32: residual, norms, q/k/v/o, MLP (3 x
#: intermediate is folded in separately). A deliberate overestimate; it only has to keep the forward pass from
#: running out of what the cache left.
_ACTIVATION_HIDDEN_MULTIPLE = 8

#: Bytes of float32 logits a step may spend on prompt log-probability rows (scoring): the scheduler plans no more
#: such rows per step than this holds (``max_prompt_logprob_rows``), and the memory budget charges them.
SCORING_LOGITS_BYTES = 2**30


def max_prompt_logprob_rows(config: EngineConfig, vocab_size: int) -> int:
    """Most prompt log-probability rows one step may score: what ``SCORING_LOGITS_BYTES`` holds of float32 rows
    of ``vocab_size``, at most ``max_batch_tokens`` (a row per token), at least one. At a 128k vocabulary that is
    2,092 rows a step (8,192 tokens would be 4 GiB of logits); at 32k, up to 8,388."""
    return max(1, min(config.limits.max_batch_tokens, SCORING_LOGITS_BYTES // (4 * vocab_size)))


#: (rows, V) float32-sized tensors the sampler holds at its peak per sampled row: its float32 copy, the
#: probabilities, a sort's values and int64 order, their cumulative sum and the kept mask. A deliberate overestimate.
_SAMPLER_ROW_COPIES = 8


def max_sample_rows(config: EngineConfig) -> int:
    """Most sampled logit rows one step can have: one per request, 1 + ``num_speculative_tokens`` when it verifies
    proposals."""
    per_request = 1 + (config.num_speculative_tokens if config.speculative != "off" else 0)
    return config.limits.max_requests_per_batch * per_request


def max_logit_rows(config: EngineConfig, vocab_size: int) -> int:
    """Most logit rows one step can produce: its sampled rows and the prompt log-probability rows the scheduler
    lets it score."""
    return max_sample_rows(config) + max_prompt_logprob_rows(config, vocab_size)


def cuda_memory_bytes(device: str) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device (``torch.cuda.mem_get_info``): free counts every process's use."""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


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


def step_workspace_bytes(config: EngineConfig, model_config: ModelConfig) -> int:
    """Memory one step needs besides the cache: activations for ``max_batch_tokens``; the logits it can produce
    (``max_logit_rows`` rows, counted as float32); the sampler's intermediates over its sampled rows
    (``_SAMPLER_ROW_COPIES`` per row); the prompt log-probabilities' scratch (``PROMPT_LOGPROB_CHUNK_BYTES``: they
    are scored a chunk at a time, never a second copy of every row); and the index tensors (input ids, positions,
    slot mapping, block tables)."""
    from cbrun.engine.sample.step import PROMPT_LOGPROB_CHUNK_BYTES

    limits = config.limits
    hidden: int = model_config.hidden_size
    intermediate: int = getattr(model_config, "intermediate_size", None) or 4 * hidden
    activations = limits.max_batch_tokens * (_ACTIVATION_HIDDEN_MULTIPLE * hidden + 3 * intermediate) * 4
    vocab: int = model_config.vocab_size
    logits = max_logit_rows(config, vocab) * vocab * 4 + max_sample_rows(config) * _SAMPLER_ROW_COPIES * vocab * 4
    indices = limits.max_batch_tokens * 8 * 4 + limits.max_requests_per_batch * 8 * 4
    return activations + logits + PROMPT_LOGPROB_CHUNK_BYTES + indices


def graph_pool_bytes(config: EngineConfig, model_config: ModelConfig) -> int:
    """The CUDA-graph pool's reserve: the graphs capture decode steps of up to ``max_requests_per_batch`` rows,
    whose intermediates stay allocated in the pool. Counted as one step of that many tokens (0 with graphs off)."""
    if config.cuda_graphs == "off":
        return 0
    hidden: int = model_config.hidden_size
    intermediate: int = getattr(model_config, "intermediate_size", None) or 4 * hidden
    vocab: int = model_config.vocab_size
    rows = config.limits.max_requests_per_batch
    return rows * (_ACTIVATION_HIDDEN_MULTIPLE * hidden + 3 * intermediate) * 4 + rows * vocab * 4


def memory_budget_bytes(config: EngineConfig, model_config: ModelConfig) -> tuple[int, str]:
    """Bytes the KV cache may take, and a sentence saying how they were reached (for errors and the log).

    On CUDA: ``gpu_memory_utilization`` of the device's total memory, less what is in use now (the weights, once
    loaded, and any other process's memory), a step's workspace (``step_workspace_bytes``) and the graph pool
    (``graph_pool_bytes``). On the CPU: ``max_memory_percent`` of MemAvailable, less a step's workspace.
    """
    workspace = step_workspace_bytes(config, model_config)
    if torch.device(config.device).type == "cuda":
        free, total = cuda_memory_bytes(config.device)
        graphs = graph_pool_bytes(config, model_config)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - workspace - graphs
        how = (
            f"gpu_memory_utilization={config.gpu_memory_utilization} of {total / 2**30:.2f} GiB, less "
            f"{(total - free) / 2**30:.2f} GiB in use (weights and other processes), "
            f"{workspace / 2**30:.2f} GiB of step workspace and {graphs / 2**30:.2f} GiB of graph pool"
        )
        return budget, how
    free = available_memory_bytes(config.device)
    return (
        int(free * config.max_memory_percent) - workspace,
        f"max_memory_percent={config.max_memory_percent} of {free / 2**30:.2f} GiB available, less "
        f"{workspace / 2**30:.2f} GiB of step workspace",
    )


def resolve_num_blocks(
    config: EngineConfig,
    max_model_len: int,
    bytes_per_block: int,
    model_config: ModelConfig,
    expected_requests: int | None = None,
    expected_tokens: int | None = None,
) -> int:
    """The block pool's size.

    ``config.num_blocks`` when set. Otherwise what fits in the memory budget (``memory_budget_bytes``, measured
    after the model is loaded), and never more than the work can fill (``useful_blocks``).

    Args:
        config: the engine settings.
        max_model_len: the model's maximum total length.
        bytes_per_block: K and V bytes of one block across all layers.
        model_config: the model's (text) config, for the step workspace.
        expected_requests: requests the caller will add in all, when known.
        expected_tokens: the sum over those requests of prompt plus ``max_new_tokens``, when known.

    Raises:
        ValueError: when the memory budget cannot hold even one block.
    """
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        budget, how = memory_budget_bytes(config, model_config)
        if budget < bytes_per_block:
            setting = "gpu_memory_utilization" if torch.device(config.device).type == "cuda" else "max_memory_percent"
            raise ValueError(
                f"{how} leaves no room for a KV-cache block of {bytes_per_block} bytes; raise "
                f"{setting}, lower max_batch_tokens or max_requests_per_batch, or set engine.num_blocks"
            )
        num_blocks = min(
            budget // bytes_per_block, useful_blocks(config, max_model_len, expected_requests, expected_tokens)
        )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens of capacity, %.1f MiB",
        num_blocks,
        config.limits.page_size,
        num_blocks * config.limits.page_size,
        num_blocks * bytes_per_block / 2**20,
    )
    return num_blocks


def useful_blocks(
    config: EngineConfig, max_model_len: int, expected_requests: int | None = None, expected_tokens: int | None = None
) -> int:
    """Most blocks the work could ever hold at once.

    Every request slot that can run together (``max_requests_per_batch``, or fewer when fewer requests are
    expected) grows to at most ``max_model_len`` tokens; and all expected requests together hold at most
    ``expected_tokens`` (plus one partly filled block each). The smaller bound wins; at least one block.
    """
    limits = config.limits
    slots = min(limits.max_requests_per_batch, expected_requests or limits.max_requests_per_batch)
    blocks = slots * cdiv(max_model_len, limits.page_size)
    if expected_tokens is not None:
        blocks = min(blocks, cdiv(expected_tokens, limits.page_size) + slots)
    return max(1, blocks)
