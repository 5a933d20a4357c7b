"""The engine's paged attention, plugged into transformers' attention interface.

transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, ...)``
and pass through any keyword the model's ``forward`` received. The engine loads models with
``attn_implementation="cbrun_paged"`` and passes this step's ``AttentionMetadata`` as ``cbrun_metadata``: each
layer writes its new K/V into the paged cache through the slot mapping, then attends over the block tables.
Because the name is not a mask implementation, transformers builds no attention mask at all. The name is
registered by ``register_with_transformers``, which whoever loads a transformers model with it calls (importing
this module does not import transformers: the lean path runs ``paged_attention`` without it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cbrun.engine.core.cache_spec import slot_address
from cbrun.engine.model.layers.attention_contract import AttentionProbe, check_hook_kwargs, refusal
from cbrun.kernels.reference import GatherPlan, build_gather_plan, paged_attention_ref, write_kv_cache_ref

ATTN_IMPLEMENTATION = "cbrun_paged"


@dataclass
class GroupMetadata:
    """Where one allocator's layers (full or sliding) find this step's tokens.

    Block ``b`` of a group with ``layers_per_block`` layers owns pages ``b * layers_per_block + i``, one per layer
    ``i`` of the group, so both tensors below point at the group's first layer and shift by ``i`` per layer.

    Attributes:
        slot_mapping: (T,) int64 cache slot (page * page_size + offset) of each new token, for layer 0.
        block_tables: (B, max_blocks) int32 page of each logical block, for layer 0, padded with page 0 (a
            reserved padding chunk). For a sliding group, logical block j maps to ring block j % ring size.
        layers_per_block: pages per block.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    layers_per_block: int
    _per_layer: dict = field(default_factory=dict)

    def for_layer(self, index: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_mapping, block_tables) of the group's layer ``index``.

        Layer ``index`` of block b is page ``page_address(b, layers_per_block, index)``, layer 0's page plus
        ``index`` (``cbrun.engine.core.cache_spec``), so its slots are layer 0's plus ``index`` pages of ``page_size``.
        """
        cached = self._per_layer.get(index)
        if cached is None:
            slots = self.slot_mapping
            if index:  # padded tokens keep their negative slot: they write nowhere in any layer
                slots = torch.where(slots >= 0, slots + slot_address(index, 0, page_size), slots)
            cached = (slots, self.block_tables + index)
            self._per_layer[index] = cached
        return cached


@dataclass
class AttentionMetadata:
    """Everything a layer needs to find this step's tokens in the paged cache. Built once per step.

    NOTE: what the layers derive from it (``GroupMetadata.for_layer``'s shifted tensors, gather plans,
    ``StepKernels``) is computed on first use and cached in it. Under a CUDA graph those computations must be
    captured with the forward, so an instance is built inside the captured region from the graph's static buffers
    and never shared with an eager pass (``engine.cuda_graphs``): a replay then recomputes them from the new
    step's values instead of reading tensors left from the capture step.

    Attributes:
        groups: ``{"full": ..., "sliding": ...}`` per allocator the model uses.
        layer_groups: per layer, (group name, index of the layer within its group).
        cu_seqlens_q: (B + 1,) int32 cumulative query lengths.
        seqlens_k: (B,) int32 context length per request, this step's tokens included.
        max_seqlen_q: longest query of the step.
        page_size: tokens per page.
        k_pages, v_pages: the cache, (num_pages, page_size, num_kv_heads, head_dim), shared by all layers.
        use_triton: run the Triton kernels instead of the PyTorch reference.
        use_cpu_kernel: run ``cbrun.kernels.cpu_attention``'s C kernel (float32, CPU) instead of the PyTorch reference.
        cpu_kernel_threads: that kernel's threads (``cbrun.engine.worker.threads.resolve_attention_threads``); None for torch's.
        batch_invariant: the C kernel attends every query row on its own (``engine.batch_invariant``), and the lean
            path's MLP runs the C ``silu_mul``: a row's floats depend on the row alone, not on the step.
        kernels_as_ops: call the kernels through ``cbrun.kernels.custom_ops`` (one dispatched op per call, which the
            CUDA-graph emulation records) instead of directly.
    """

    groups: dict[str, GroupMetadata]
    layer_groups: list[tuple[str, int]]
    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    max_seqlen_q: int
    page_size: int
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    use_triton: bool = False
    use_cpu_kernel: bool = False
    cpu_kernel_threads: int | None = None
    batch_invariant: bool = False
    kernels_as_ops: bool = False
    _plans: dict = field(default_factory=dict)
    _step_kernels: object = None

    def step_kernels(self):
        """This step's ``cbrun.kernels.cpu_attention.StepKernels`` over the cache, built on first use and shared by the
        layers, so the step's block tables, slot mappings and lengths are checked and converted once."""
        if self._step_kernels is None:
            from cbrun.kernels.cpu_attention import StepKernels

            self._step_kernels = StepKernels(
                self.k_pages, self.v_pages, self.cpu_kernel_threads, batch_invariant=self.batch_invariant
            )
        return self._step_kernels

    def gather_plan(self, group: str, sliding_window: int | None) -> GatherPlan:
        """The reference path's gather plan of one group, built on first use and shared by its layers."""
        key = (group, sliding_window)
        plan = self._plans.get(key)
        if plan is None:
            plan = build_gather_plan(
                self.groups[group].block_tables, self.cu_seqlens_q, self.seqlens_k, self.page_size, sliding_window
            )
            self._plans[key] = plan
        return plan


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    cbrun_metadata: AttentionMetadata | AttentionProbe | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function over the paged cache.

    Args:
        module: the attention module; its ``layer_idx`` selects the layer's cache.
        query: (1, num_heads, T, head_dim); key, value: (1, num_kv_heads, T, head_dim), RoPE already applied.
        attention_mask: ignored (always None here: causality comes from positions and block tables).
        scaling: softmax scale; defaults to head_dim ** -0.5.
        sliding_window: the layer's window in tokens, or None.
        softcap: attention logit soft-capping (Gemma 2), or None.
        s_aux: (num_heads,) attention sinks (gpt-oss), or None.
        cbrun_metadata: this step's metadata, or the load-time ``AttentionProbe``
            (``cbrun.engine.model.layers.attention_contract``), which records the call.
        kwargs: the rest of the model's keyword arguments; any that would change attention is refused
            (``attention_contract.check_hook_kwargs``).

    Returns:
        ((1, T, num_heads, head_dim) attention output, None).

    Raises:
        RuntimeError: when called without ``cbrun_metadata`` (the model was run outside the engine).
        UnsupportedAttention: a keyword argument, a mask or a dropout the hook does not implement.
    """
    if cbrun_metadata is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} attention needs the engine's cbrun_metadata; "
            "run the model through cbrun's LLMEngine"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(cbrun_metadata, AttentionProbe):
        named = dict(kwargs, dropout=dropout, sliding_window=sliding_window, softcap=softcap, s_aux=s_aux)
        return cbrun_metadata.attend(module, query, key, value, attention_mask, scale, s_aux, named), None
    _refuse_unsupported(module, attention_mask, dropout, kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    out = paged_attention(q, k, v, cbrun_metadata, module.layer_idx, scale, sliding_window, softcap, s_aux)
    return out.unsqueeze(0), None


def _refuse_unsupported(module: torch.nn.Module, attention_mask: torch.Tensor | None, dropout: float, kwargs) -> None:
    """Refuse what the hook does not implement: a keyword that would change attention, a dropout
    (``attention_contract.check_hook_kwargs``), a mask or bias the model built.

    Raises:
        UnsupportedAttention: naming it.
    """
    check_hook_kwargs(kwargs, dropout)
    if attention_mask is not None:
        raise refusal("an attention mask or bias built by the model", f"layer {module.layer_idx}")


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    md: AttentionMetadata,
    layer_idx: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write one layer's new K/V into the paged cache, then attend over it (reference, C or Triton, per ``md``).

    Args:
        q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim), RoPE already applied; the cache's dtype.
        md: this step's metadata.
        layer_idx: the decoder layer, which selects its pages.
        scale: softmax scale.
        sliding_window: the layer's window in tokens, or None.
        softcap: attention logit soft-capping, or None.
        sinks: (num_heads,) per-head sink logits added to the softmax denominator (gpt-oss), or None.

    Returns:
        (T, num_heads, head_dim) attention output in ``q.dtype``.
    """
    # The kernels read the page size from the cache tensor, the block tables and slots were built with md's.
    assert md.k_pages.shape[1] == md.page_size, f"page size {md.page_size} but cache pages of {md.k_pages.shape[1]}"
    group, index = md.layer_groups[layer_idx]
    if sinks is not None:
        sinks = sinks.detach().float()  # the kernels add the sink logits in float32
    layer = _LayerAttention(group, index, scale, sliding_window, softcap, sinks)
    if md.kernels_as_ops:
        return _attention_as_ops(q, k, v, md, layer)
    if md.use_cpu_kernel:
        return _cpu_kernel_attention(q, k, v, md, layer)
    if md.use_triton:
        return _triton_attention(q, k, v, md, layer)
    slot_mapping, _ = md.groups[group].for_layer(index, md.page_size)
    write_kv_cache_ref(k, v, md.k_pages, md.v_pages, slot_mapping)
    return paged_attention_ref(
        q, md.k_pages, md.v_pages, md.gather_plan(group, sliding_window), scale, softcap, page_offset=index, sinks=sinks
    )


@dataclass(frozen=True)
class _LayerAttention:
    """One layer's part of a ``paged_attention`` call, as each backend takes it: its cache group and its index in
    the group (which select its pages and page shift), and how it scores (``paged_attention``'s arguments; the
    sinks in float32)."""

    group: str
    index: int
    scale: float
    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None


def _triton_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, layer: _LayerAttention
) -> torch.Tensor:
    """``paged_attention`` on the Triton kernels (``cbrun.kernels.paged_attention``), with the layer's own slots and
    block tables (``GroupMetadata.for_layer``)."""
    from cbrun.kernels.kv_cache_write import write_kv_cache_triton
    from cbrun.kernels.paged_attention import paged_attention_triton

    slot_mapping, block_tables = md.groups[layer.group].for_layer(layer.index, md.page_size)
    write_kv_cache_triton(k, v, md.k_pages, md.v_pages, slot_mapping)
    return paged_attention_triton(
        q,
        md.k_pages,
        md.v_pages,
        block_tables,
        md.cu_seqlens_q,
        md.seqlens_k,
        layer.scale,
        sliding_window=layer.sliding_window,
        softcap=layer.softcap,
        sinks=layer.sinks,
        max_seqlen_q=md.max_seqlen_q,
        batch_invariant=md.batch_invariant,
    )


def _cpu_kernel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, layer: _LayerAttention
) -> torch.Tensor:
    """``paged_attention`` on the C kernels (``cbrun.kernels.cpu_attention``): the K/V write and the attention each take
    the group's layer-0 slot mapping and block tables with the layer's page shift, applied in C, so no layer makes
    shifted copies of them (``GroupMetadata.for_layer``, which the other backends use), and the step's
    ``StepKernels`` converts them once for all layers."""
    kernels = md.step_kernels()
    layer0 = md.groups[layer.group]
    kernels.write_kv(k, v, layer0.slot_mapping, slot_address(layer.index, 0, md.page_size))
    return kernels.attention(
        q,
        layer0.block_tables,
        md.cu_seqlens_q,
        md.seqlens_k,
        layer.scale,
        layer.softcap,
        layer.sliding_window,
        page_offset=layer.index,
        sinks=layer.sinks,
    )


def _attention_as_ops(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, layer: _LayerAttention
) -> torch.Tensor:
    """``paged_attention`` through ``cbrun.kernels.custom_ops``, each backend given what its direct call gets: the C
    kernel layer 0's slots and tables with the layer's shift, the reference the layer's slots and layer 0's
    tables with the shift, Triton the layer's own slots and tables (``GroupMetadata.for_layer``)."""
    import cbrun.kernels.custom_ops  # noqa: F401  (registers torch.ops.cbrun)

    ops = torch.ops.cbrun
    threads = md.cpu_kernel_threads or 0
    index = layer.index
    layer0 = md.groups[layer.group]
    if md.use_cpu_kernel:
        backend, slots, slot_offset, tables, page_offset = (
            "cpu",
            layer0.slot_mapping,
            slot_address(index, 0, md.page_size),
            layer0.block_tables,
            index,
        )
    else:
        slots, layer_tables = layer0.for_layer(index, md.page_size)
        backend, slot_offset = ("triton" if md.use_triton else "torch"), 0
        tables, page_offset = (layer_tables, 0) if md.use_triton else (layer0.block_tables, index)
    ops.write_kv_cache(k, v, md.k_pages, md.v_pages, slots, slot_offset, backend, threads)
    return ops.paged_attention(
        q,
        md.k_pages,
        md.v_pages,
        tables,
        md.cu_seqlens_q,
        md.seqlens_k,
        layer.scale,
        layer.sliding_window,
        layer.softcap,
        md.max_seqlen_q,
        page_offset,
        backend,
        threads,
        layer.sinks,
    )


def register_with_transformers() -> str:
    """Register ``paged_attention_forward`` as transformers' attention ``ATTN_IMPLEMENTATION`` (imports
    transformers; calling it again is harmless). Returns the name, for ``attn_implementation=``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
