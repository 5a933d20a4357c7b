"""Which backends an engine runs on its device, chosen once from its config: the attention kernels (Triton, the C
CPU kernel, or the PyTorch reference), CUDA graphs (real or emulated) and their batch buckets, and the speculative
decoding combinations refused."""

from __future__ import annotations

import torch

from cbrun.engine.config import EngineConfig
from cbrun.engine.core.kv_layout import SLIDING, KVLayout
from cbrun.engine.switches import resolve_switch
from cbrun.engine.worker.padding import GraphBuckets


def use_cuda_graphs(config: EngineConfig, use_triton: bool) -> bool:
    """Whether to replay decode steps from CUDA graphs, real or emulated; says why not, once, when it cannot."""
    if config.cuda_graphs == "emulate":  # on any device and backend
        return True
    return resolve_switch(
        "cuda_graphs", config.cuda_graphs, cuda_graphs_blocker(config, use_triton), off_log="CUDA graphs off: %s"
    )


def cuda_graphs_blocker(config: EngineConfig, use_triton: bool) -> str | None:
    """Why CUDA graphs cannot run in this engine, or None when they can."""
    if torch.device(config.device).type != "cuda":
        return f"the device is {config.device}, not CUDA"
    if not use_triton:
        return "attention_backend = torch synchronises with the host, which a graph cannot hold"
    return None


def graph_buckets(config: EngineConfig, max_model_len: int) -> GraphBuckets:
    """The shapes decode (and, with speculation, uniform verify) steps are graphed at."""
    max_batch_size = min(
        config.cuda_graph_max_batch_size or config.max_requests_per_batch, config.max_requests_per_batch
    )
    max_query_len = 1 + config.num_speculative_tokens if config.speculative != "off" else 1
    return GraphBuckets(max_batch_size, max_query_len, max_model_len, config.page_size)


def check_speculative(config: EngineConfig, layout: KVLayout) -> None:
    """Refuse speculative decoding where it is not supported yet.

    Raises:
        ValueError: for a draft model over a target with sliding-window layers (the draft's cache is addressed by
            the target's full blocks), or with async batching "on".
    """
    if config.speculative == "off":
        return
    if config.speculative == "draft" and SLIDING in layout.layer_types:
        raise ValueError(
            'speculative = "draft" does not support sliding-window target models yet (the draft\'s '
            'cache pages follow the target\'s full-attention blocks); use speculative = "ngram"'
        )
    if config.async_batching == "on":
        raise ValueError(
            f'speculative = {config.speculative!r} does not run with async_batching = "on" yet '
            '(a verify step\'s tokens must be read before the next plan); set one of them to "off"'
        )


def use_cpu_kernel(config: EngineConfig, dtype: torch.dtype, use_triton: bool) -> bool:
    """Whether attention runs ``cbrun.kernels.cpu_attention``'s C kernel: "cpu", or "auto" off CUDA where it applies.

    Raises:
        ValueError: ``attention_backend = "cpu"`` on a CUDA device, with a dtype other than float32, or where the
            kernel cannot be built (the message says why).
    """
    if use_triton or config.attention_backend == "torch":
        return False
    reason = None
    if torch.device(config.device).type != "cpu":
        reason = f"the device is {config.device}, not the CPU"
    elif dtype != torch.float32:
        reason = f"the model's dtype is {dtype}; the CPU kernel is float32 only"
    else:
        from cbrun.kernels.cpu_attention import unavailable_reason

        failure = unavailable_reason()
        reason = f"the CPU attention kernel is unavailable ({failure})" if failure else None
    return resolve_switch(
        "attention_backend",
        config.attention_backend,
        reason,
        on="cpu",
        off="torch",
        off_log="attention: PyTorch reference (%s)",
        hint="; use attention_backend = torch",
    )


def use_triton(config: EngineConfig) -> bool:
    """Whether attention runs the Triton kernels: "auto" on CUDA devices. Not a ``resolve_switch``: "triton" runs
    on any device (on the CPU through Triton's interpreter, as the tests do), so nothing can block it."""
    if config.attention_backend == "auto":
        return torch.device(config.device).type == "cuda"
    return config.attention_backend == "triton"
