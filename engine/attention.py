"""The engine's paged attention, plugged into transformers' attention interface.

transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, ...)``
and pass through any keyword the model's ``forward`` received. The engine loads models with
``attn_implementation="cbrun_paged"`` and passes this step's ``AttentionMetadata`` as ``cbrun_metadata``: each
layer writes its new K/V into the paged cache through the slot mapping, then attends over the block tables.
Because the name is not a mask implementation, transformers builds no attention mask at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from kernels.reference import GatherPlan, build_gather_plan, paged_attention_ref, write_kv_cache_ref

ATTN_IMPLEMENTATION = "cbrun_paged"


@dataclass
class AttentionMetadata:
    """Everything a layer needs to find this step's tokens in the paged cache. Built once per step.

    Attributes:
        slot_mapping: (T,) int64 flat cache slot of each new token.
        block_tables: (B, max_blocks) int32 block ids per request, padded with 0.
        cu_seqlens_q: (B + 1,) int32 cumulative query lengths.
        seqlens_k: (B,) int32 context length per request, this step's tokens included.
        max_seqlen_q: longest query of the step.
        page_size: tokens per block.
        k_caches, v_caches: per layer, (num_blocks, page_size, num_kv_heads, head_dim).
        use_triton: run the Triton kernels instead of the PyTorch reference.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    max_seqlen_q: int
    page_size: int
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    use_triton: bool = False
    _plans: dict = field(default_factory=dict)

    def gather_plan(self, sliding_window: int | None) -> GatherPlan:
        """The reference path's gather plan for one window size, built on first use and shared by layers."""
        plan = self._plans.get(sliding_window)
        if plan is None:
            plan = build_gather_plan(self.block_tables, self.cu_seqlens_q, self.seqlens_k, self.page_size,
                                     sliding_window)
            self._plans[sliding_window] = plan
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
    cbrun_metadata: AttentionMetadata | None = None,
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
        cbrun_metadata: this step's metadata.

    Returns:
        ((1, T, num_heads, head_dim) attention output, None).

    Raises:
        RuntimeError: when called without ``cbrun_metadata`` (the model was run outside the engine).
    """
    if cbrun_metadata is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the engine's cbrun_metadata; "
                           "run the model through cbrun's LLMEngine")
    md = cbrun_metadata
    layer = module.layer_idx
    q = query[0].transpose(0, 1)  # (T, H, D)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    k_cache, v_cache = md.k_caches[layer], md.v_caches[layer]
    if md.use_triton:
        from kernels.kv_cache_write import write_kv_cache_triton
        from kernels.paged_attention import paged_attention_triton
        write_kv_cache_triton(k.contiguous(), v.contiguous(), k_cache, v_cache, md.slot_mapping)
        out = paged_attention_triton(q.contiguous(), k_cache, v_cache, md.block_tables, md.cu_seqlens_q,
                                     md.seqlens_k, scale, sliding_window=sliding_window, softcap=softcap,
                                     max_seqlen_q=md.max_seqlen_q)
    else:
        write_kv_cache_ref(k, v, k_cache, v_cache, md.slot_mapping)
        out = paged_attention_ref(q, k_cache, v_cache, md.gather_plan(sliding_window), scale, softcap)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
