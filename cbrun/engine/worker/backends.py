"""Which backends an engine runs on its device, chosen once from its config: the attention kernels (Triton, the C
CPU kernel, or the PyTorch reference), CUDA graphs (real or emulated) and their batch buckets, and the speculative
decoding combinations refused."""

from __future__ import annotations

from typing import Any

import torch

from cbrun.engine.config import EngineConfig
from cbrun.engine.core.kv_layout import SLIDING, KVLayout, ModelConfig
from cbrun.engine.setting_error import SettingError
from cbrun.engine.switches import resolve_switch
from cbrun.engine.worker.padding import GraphBuckets
from cbrun.kernels.batch_invariant import InvariantKernels


def use_cuda_graphs(config: EngineConfig, use_triton: bool, model_config: ModelConfig | None = None) -> bool:
    """Whether to replay decode steps from CUDA graphs, real or emulated; says why not, once, when it cannot.

    Args:
        model_config: the model's (text) config, to refuse a forward pass that reads values back to the host
            (``forward_host_read``); None skips that check.

    Raises:
        ValueError: for ``cuda_graphs = "on"`` (or "emulate") where graphs cannot run, naming why.
    """
    host_read = forward_host_read(model_config) if model_config is not None else None
    if config.cuda_graphs == "emulate":  # on any device and backend
        if host_read is not None:
            raise SettingError("{cuda_graphs} = emulate, but {reason}", reason=host_read)
        return True
    blocker = cuda_graphs_blocker(config, use_triton) or host_read
    return resolve_switch("cuda_graphs", config.cuda_graphs, blocker, off_log="CUDA graphs off: %s")


def forward_host_read(model_config: ModelConfig) -> str | None:
    """Why the model's transformers forward pass reads a value back to the host (which a graph cannot capture: its
    replay would keep the capture step's value, or the capture fails), or None when it reads nothing.

    Known readers: dynamic RoPE scaling (transformers' ``dynamic_rope_update`` compares the longest position with
    its cached length on the host, and recomputes the frequencies when it grows) and transformers' mixture-of-experts
    blocks (they loop over the experts a step's tokens hit, found with ``nonzero``). Such a model runs eager.
    """
    for params in _rope_parameters(model_config):
        kind = params.get("rope_type", params.get("type"))
        if isinstance(kind, str) and "dynamic" in kind:
            return (
                f"the model's forward pass reads a value back to the host: dynamic RoPE scaling (rope_type "
                f"{kind!r}) compares its longest position with the cached length on the host, which a graph "
                "cannot capture; the model runs eager"
            )
    for name in ("num_experts", "num_local_experts"):
        if (getattr(model_config, name, None) or 0) > 1:
            return (
                "the model's forward pass reads a value back to the host: transformers' mixture-of-experts "
                f"blocks ({name} = {getattr(model_config, name)}) find the experts a step's tokens hit with nonzero "
                "and loop over them on the host, which a graph cannot capture; the model runs eager"
            )
    return None


def _rope_parameters(model_config: ModelConfig) -> list[dict[str, Any]]:
    """The model's RoPE parameter dicts (``rope_scaling`` / ``rope_parameters``, one per layer type when nested)."""
    found: list[dict[str, Any]] = []
    for name in ("rope_scaling", "rope_parameters"):
        value = getattr(model_config, name, None)
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            found.extend(nested or [value])
    return found


def cuda_graphs_blocker(config: EngineConfig, use_triton: bool) -> str | None:
    """Why CUDA graphs cannot run in this engine, or None when they can."""
    if torch.device(config.device).type != "cuda":
        return f"the device is {config.device}, not CUDA"
    if config.tensor_parallel_size > 1:
        return "tensor_parallel_size > 1 runs the lean path, which graphs do not capture"
    if config.batch_invariant == "on":
        return "batch_invariant = on runs the lean forward pass with its invariant kernels, which graphs do not capture"
    if not use_triton:
        return "attention_backend = torch synchronises with the host, which a graph cannot hold"
    return None


def graph_buckets(config: EngineConfig, max_model_len: int) -> GraphBuckets:
    """The shapes decode (and, with speculation, uniform verify) steps are graphed at."""
    limits = config.limits
    max_batch_size = min(
        config.cuda_graph_max_batch_size or limits.max_requests_per_batch, limits.max_requests_per_batch
    )
    max_query_len = 1 + config.num_speculative_tokens if config.speculative != "off" else 1
    return GraphBuckets(max_batch_size, max_query_len, max_model_len, limits.page_size)


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
    elif config.kv_cache_dtype != "auto":
        reason = f"kv_cache_dtype = {config.kv_cache_dtype}: the C kernel reads K/V in the model's dtype"
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
    on any device (on the CPU through Triton's interpreter, as the tests do), so nothing can block it. An fp8 KV
    cache (``kv_cache_dtype``) runs the PyTorch reference, which dequantizes the pages it reads."""
    if config.attention_backend == "auto":
        return torch.device(config.device).type == "cuda" and config.kv_cache_dtype == "auto"
    return config.attention_backend == "triton"


def batch_invariant_blocker(
    config: EngineConfig,
    cpu_kernel: bool,
    cuda_graphs: bool,
    use_triton: bool = False,
    dtype: torch.dtype = torch.float32,
) -> str | None:
    """Why ``batch_invariant`` cannot run in this engine, or None when it can (the lean path is checked when it is
    chosen: ``cbrun.engine.model.model_impl.select_lean_model``).

    Two kernel sets run it: on the CPU, the C attention kernel with ``cpu_linear.batch_invariant_linear``; with
    Triton attention (CUDA, or the CPU under Triton's interpreter), the Triton invariant kernels
    (``cbrun.kernels.batch_invariant``).

    Args:
        config: the engine's settings.
        cpu_kernel: whether attention runs the C kernel (``use_cpu_kernel``).
        cuda_graphs: whether CUDA graphs (real or emulated) run (``use_cuda_graphs``).
        use_triton: whether attention runs the Triton kernels (``use_triton``).
        dtype: the model's dtype.
    """
    return _invariant_kernel_blocker(config, cpu_kernel, use_triton, dtype) or _invariant_setting_blocker(
        config, cuda_graphs
    )


def _invariant_kernel_blocker(
    config: EngineConfig, cpu_kernel: bool, use_triton: bool, dtype: torch.dtype
) -> str | None:
    """Why no batch-invariant kernel set runs on this device and attention backend (``batch_invariant_blocker``)."""
    device = torch.device(config.device)
    if device.type == "cuda" or (use_triton and not cpu_kernel):
        if not use_triton:
            # NOTE: the reference attention pads each group to its own longest query: a row's sums follow the batch.
            return (
                f"attention does not run the Triton kernels on {config.device} (attention_backend = "
                f"{config.attention_backend}, kv_cache_dtype = {config.kv_cache_dtype})"
            )
        from cbrun.kernels.batch_invariant import triton_invariant_unavailable_reason

        return triton_invariant_unavailable_reason(device, dtype)
    if device.type != "cpu":
        return f"the device is {config.device}; batch-invariant kernels run on CUDA and the CPU"
    if not cpu_kernel:
        return "attention does not run the C CPU kernel (it needs float32 and attention_backend = auto or cpu)"
    return None


def _invariant_setting_blocker(config: EngineConfig, cuda_graphs: bool) -> str | None:
    """Which other setting makes a row's sums depend on its batch (``batch_invariant_blocker``), or None."""
    if config.fp8_activation_scheme != "none":
        return (
            f"fp8_activation_scheme = {config.fp8_activation_scheme} (torch._scaled_mm's sums are not batch-invariant)"
        )
    if cuda_graphs:
        return "CUDA graphs capture transformers' forward pass, not the lean one"
    if config.linear_backend != "auto":
        return f"linear_backend = {config.linear_backend} (the invariant linear chooses its own GEMM)"
    if config.tensor_parallel_size > 1:
        # NOTE: the invariant linear runs on rank 0 only, and a collective's summation order may follow the
        # tensor's size (gloo's ring chunks it), so a row's bits could depend on its batch.
        return f"tensor_parallel_size = {config.tensor_parallel_size} (the ranks' partial sums are not batch-invariant)"
    if config.speculative != "off":
        # NOTE: whether a row speculates depends on the batch (speculative_max_batch), and so do its draws.
        return f"speculative = {config.speculative} (a row's proposals depend on its batch)"
    return None


def use_batch_invariant(
    config: EngineConfig,
    cpu_kernel: bool,
    cuda_graphs: bool,
    use_triton: bool = False,
    dtype: torch.dtype = torch.float32,
) -> bool:
    """Whether the batch-invariant forward runs: only under "on" ("auto" is resolved by the job, which knows
    whether its rows are sampled; the engine takes it as "off").

    Raises:
        ValueError: "on" where ``batch_invariant_blocker`` gives a reason.
    """
    if config.batch_invariant != "on":
        return False
    return resolve_switch(
        "batch_invariant",
        "on",
        batch_invariant_blocker(config, cpu_kernel, cuda_graphs, use_triton, dtype),
        hint="; set engine.batch_invariant = off",
    )


def invariant_kernels(config: EngineConfig, cpu_kernel: bool, dtype: torch.dtype) -> InvariantKernels | None:
    """The Triton invariant kernels a batch-invariant engine runs (``cbrun.kernels.batch_invariant``), or None
    where the CPU's own run (the C attention kernel: ``cpu_linear.batch_invariant_linear``, C ``silu_mul``)."""
    if cpu_kernel:
        return None
    from cbrun.kernels.batch_invariant import triton_invariant_kernels

    return triton_invariant_kernels(torch.device(config.device), dtype)


def batch_invariant_blocker_before_load(config: EngineConfig, model_path: str, dtype: str) -> str | None:
    """``batch_invariant_blocker`` for an engine not built yet (a job resolving "auto"), from its settings and the
    model's config.json: also why the lean path would not run (``model_impl = transformers``, or a config
    ``cbrun.engine.model.config`` does not read). None when "on" would run.

    Args:
        dtype: the dtype the engine will run in, resolved once by the caller (``EngineConfig.resolve_dtype``).
    """
    from cbrun.engine.model.config import read_config_json
    from cbrun.engine.model.registry import family_of, parse_config

    if config.model_impl == "transformers":
        return "model_impl = transformers (it needs the lean forward pass)"
    try:
        parsed, reason = parse_config(read_config_json(model_path))
    except (OSError, ValueError) as exc:
        parsed, reason = None, f"config.json cannot be read ({exc})"
    if reason:
        return f"the lean forward pass would not run: {reason}"
    assert parsed is not None  # parse_config gives a config or a reason
    reason = family_of(parsed).batch_invariant_reason(parsed)
    if reason:
        return reason
    if parsed.quantization is not None:
        # NOTE: each quantized GEMM dequantizes its weight in chunks of its own shape (LeanLlama refuses them).
        return "quantized weights (their GEMMs are not batch-invariant)"
    triton = use_triton(config)
    cpu_kernel = not triton and torch.device(config.device).type == "cpu" and dtype == "float32"
    cpu_kernel = cpu_kernel and config.attention_backend in ("auto", "cpu") and config.kv_cache_dtype == "auto"
    if cpu_kernel:
        from cbrun.kernels.cpu_attention import unavailable_reason

        cpu_kernel = unavailable_reason() is None
    # NOTE: "auto" CUDA graphs turn off under batch_invariant = on (``cuda_graphs_blocker``); "on" blocks it.
    graphs = config.cuda_graphs == "emulate" or (
        config.cuda_graphs == "on" and torch.device(config.device).type == "cuda"
    )
    return batch_invariant_blocker(config, cpu_kernel, graphs, triton, getattr(torch, dtype))
