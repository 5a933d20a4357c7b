"""The paged-attention kernels and the MoE kernels as ``torch.library`` custom ops: ``torch.ops.cbrun.write_kv_cache``,
``torch.ops.cbrun.paged_attention``, ``torch.ops.cbrun.fused_moe`` and ``torch.ops.cbrun.cpu_moe``.

A Triton launch or a C call is not a torch op, so a ``TorchDispatchMode`` (the CUDA-graph emulation,
``cbrun.engine.worker.graph_emulation``) would not see it. Wrapped as custom ops, each call is dispatched as one op whose tensor
arguments are all it reads or writes, so a recorder can replay it over the same tensors. The ops only forward to
the existing entry points: Triton (``cbrun.kernels.paged_attention``, ``cbrun.kernels.kv_cache_write``,
``cbrun.kernels.fused_moe``), the C kernels
(``cbrun.kernels.cpu_attention``, ``cbrun.kernels.cpu_moe``) or the PyTorch reference (``cbrun.kernels.reference``), picked by ``backend``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cbrun.kernels.reference import build_gather_plan, paged_attention_ref, write_kv_cache_ref

if TYPE_CHECKING:
    from cbrun.kernels.cpu_attention import StepKernels

#: The ``backend`` argument's values.
BACKENDS = ("torch", "triton", "cpu")


@torch.library.custom_op("cbrun::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_offset: int,
    backend: str,
    num_threads: int,
) -> None:
    """Store one layer's keys and values in the paged cache, in place.

    Args:
        key, value: (T, num_kv_heads, head_dim) in the cache's dtype.
        k_cache, v_cache: (num_pages, page_size, num_kv_heads, head_dim), written in place.
        slot_mapping: (T,) int64 slots; a negative slot (padding) writes nowhere.
        slot_offset: added to every non-negative slot (the C backend shifts layer 0's slots to the layer's);
            must be 0 for the other backends, which take the layer's own slots.
        backend: one of ``BACKENDS``.
        num_threads: the C kernel's threads; 0 for torch's count.

    Raises:
        ValueError: for an unknown backend, or as the backend's entry point raises.
    """
    if backend == "cpu":
        _step_kernels(k_cache, v_cache, num_threads).write_kv(key, value, slot_mapping, slot_offset)
        return
    _check_backend(backend)
    assert slot_offset == 0, "the Triton and reference writes take the layer's own slots"
    if backend == "triton":
        from cbrun.kernels.kv_cache_write import write_kv_cache_triton

        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping)


@torch.library.custom_op("cbrun::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    max_seqlen_q: int,
    page_offset: int,
    backend: str,
    num_threads: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a flattened varlen batch over the paged cache.

    Args:
        query: (T, num_heads, head_dim); rows past ``cu_seqlens_q[-1]`` are padding.
        k_cache, v_cache: (num_pages, page_size, num_kv_heads, head_dim).
        block_tables: (B, max_blocks) int32 pages; Triton takes the layer's own pages (``page_offset`` 0), the C
            kernel and the reference take layer 0's and add ``page_offset``.
        cu_seqlens_q: (B + 1,) int32; seqlens_k: (B,) int32.
        scale, sliding_window, softcap: as ``cbrun.kernels.paged_attention.paged_attention_triton``.
        max_seqlen_q: the longest query (picks Triton's tile).
        backend: one of ``BACKENDS``.
        num_threads: the C kernel's threads; 0 for torch's count.
        sinks: (num_heads,) float32 attention-sink logits (gpt-oss), or None.

    Returns:
        (T, num_heads, head_dim) in ``query.dtype``, a new tensor.
    """
    _check_backend(backend)
    layout = (block_tables, cu_seqlens_q, seqlens_k)  # each request's query rows, context length and pages
    if backend == "cpu":
        kernels = _step_kernels(k_cache, v_cache, num_threads)
        return kernels.attention(query, *layout, scale, softcap, sliding_window, page_offset, sinks=sinks)
    if backend == "triton":
        from cbrun.kernels.paged_attention import paged_attention_triton

        assert page_offset == 0, "the Triton kernel takes the layer's own block tables"
        return paged_attention_triton(
            query, k_cache, v_cache, *layout, scale, sliding_window, softcap, max_seqlen_q, sinks=sinks
        )
    plan = build_gather_plan(*layout, k_cache.shape[1], sliding_window)
    return paged_attention_ref(query, k_cache, v_cache, plan, scale, softcap, page_offset=page_offset, sinks=sinks)


def _step_kernels(k_cache: torch.Tensor, v_cache: torch.Tensor, num_threads: int) -> "StepKernels":
    """The C kernels over this cache (``num_threads`` 0: torch's count), imported at first use: the C library is
    built on first use, and only the ``cpu`` backend needs it."""
    from cbrun.kernels.cpu_attention import StepKernels

    return StepKernels(k_cache, v_cache, num_threads or None)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


@torch.library.custom_op("cbrun::fused_moe", mutates_args=())
def fused_moe(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate: list[torch.Tensor],
    up: list[torch.Tensor],
    down: list[torch.Tensor],
    weight_format: str,
    down_format: str,
    blocks: list[int],
    activation: str,
    gate_bias: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """A MoE block's experts for routed tokens: ``cbrun.kernels.fused_moe.fused_moe_triton`` as one op.

    Args:
        x, routing_weights, expert_ids: as ``fused_moe_triton``.
        gate, up, down: each projection's ``ExpertWeights`` tensors (``fused_moe.expert_op_args``): values, then
            scales and zero points where the format has them.
        weight_format: gate's and up's format; down_format: down's. blocks: gate/up's block then down's (4 ints).
        activation, gate_bias, up_bias, down_bias, alpha, limit: as ``fused_moe_triton``.

    Returns:
        (T, hidden) in x's dtype, a new tensor.
    """
    from cbrun.kernels.fused_moe import expert_weights_from_op_args, fused_moe_triton

    hidden = x.shape[1]
    gate_w = expert_weights_from_op_args(weight_format, gate, hidden, (blocks[0], blocks[1]))
    up_w = expert_weights_from_op_args(weight_format, up, hidden, (blocks[0], blocks[1]))
    down_w = expert_weights_from_op_args(down_format, down, gate_w.out_features, (blocks[2], blocks[3]))
    return fused_moe_triton(
        x, routing_weights, expert_ids, gate_w, up_w, down_w, activation, gate_bias, up_bias, down_bias, alpha, limit
    )


@torch.library.custom_op("cbrun::cpu_moe", mutates_args=())
def cpu_moe(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    num_threads: int,
) -> torch.Tensor:
    """A MoE block's experts for routed tokens on the CPU: ``cbrun.kernels.cpu_moe.moe_experts`` as one op.

    Args:
        x, routing_weights, expert_ids, gate_up, down, num_threads: as ``moe_experts``.

    Returns:
        (T, hidden) in x's dtype, a new tensor.
    """
    from cbrun.kernels.cpu_moe import moe_experts

    return moe_experts(x, routing_weights, expert_ids, gate_up, down, num_threads)
