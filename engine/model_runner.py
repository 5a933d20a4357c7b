"""The model runner: turns a step's plan into flattened tensors, runs the model, returns next-token logits."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.scheduler import ScheduledRequest, SchedulerOutput


class KVCache:
    """The paged KV cache and its CPU swap buffer.

    ``kv`` has shape (2, num_layers, num_blocks, page_size, num_kv_heads, head_dim): K then V; ``k[layer]`` and
    ``v[layer]`` are views of shape (num_blocks, page_size, num_kv_heads, head_dim). ``cpu_kv`` is the same with
    ``num_cpu_blocks`` (pinned on CUDA), so an offload or restore is one gather and one copy for all layers.
    """

    def __init__(self, num_layers: int, num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_cpu_blocks: int = 0) -> None:
        shape = (2, num_layers, num_blocks, page_size, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.k = list(self.kv[0].unbind(0))
        self.v = list(self.kv[1].unbind(0))
        pin = torch.device(device).type == "cuda"
        cpu_shape = (2, num_layers, num_cpu_blocks, page_size, num_kv_heads, head_dim)
        self.cpu_kv = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin) if num_cpu_blocks else None

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """K and V bytes of one block across all layers."""
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy ``(device block, CPU slot)`` pairs out, then ``(CPU slot, device block)`` pairs in."""
        if swap_out:
            src, dst = zip(*swap_out)
            self.cpu_kv[:, :, list(dst)] = self.kv[:, :, list(src)].to("cpu", non_blocking=True)
        if swap_in:
            src, dst = zip(*swap_in)
            self.kv[:, :, list(dst)] = self.cpu_kv[:, :, list(src)].to(self.kv.device, non_blocking=True)


class ModelRunner:
    """Executes a plan. Owns the model, the KV-cache tensors and the per-step input tensors; decides nothing.

    The batch is flattened: the scheduled requests' new tokens are laid end to end as one sequence of T tokens
    (no padding), with positions, a slot mapping and block tables telling attention where each request's
    context lives.

    Args:
        model: a transformers causal LM loaded with ``attn_implementation="cbrun_paged"``.
        kv_cache: the cache tensors.
        page_size: tokens per block.
        use_triton: attention through the Triton kernels.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, page_size: int, use_triton: bool = False) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.use_triton = use_triton
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> torch.Tensor | None:
        """Make the plan's offload copies, then run one forward pass.

        Args:
            plan: the step's plan; each scheduled entry computes ``num_tokens`` tokens from its
                ``num_computed_tokens``.

        Returns:
            (N, vocab_size) logits in plan order: for each entry, one row per ``prompt_logprob_positions()``
            position, then one row if it ``samples``. None when nothing is scheduled.
        """
        if plan.swap_out or plan.swap_in:
            self.kv_cache.swap(plan.swap_out, plan.swap_in)
        scheduled = plan.scheduled
        if not scheduled:
            return None
        input_ids, positions, md, logits_indices = self._prepare(scheduled)
        output = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                            logits_to_keep=logits_indices, cbrun_metadata=md)
        return output.logits[0]

    def _prepare(self, scheduled: list[ScheduledRequest]):
        token_ids, positions, q_lens, seqlens_k, logits_indices, tables = [], [], [], [], [], []
        offset = 0
        for item in scheduled:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_tokens
            token_ids.extend(request.token_ids(start, end))
            positions.extend(range(start, end))
            q_lens.append(item.num_tokens)
            seqlens_k.append(end)
            tables.append(request.block_table)
            logits_indices.extend(offset + p - start for p in item.prompt_logprob_positions())
            offset += item.num_tokens
            if item.samples:
                logits_indices.append(offset - 1)
        device = self.device
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        cu_seqlens_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(q_lens_t, 0, out=cu_seqlens_q[1:])
        positions_t = torch.tensor(positions, dtype=torch.int64)
        request_index = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t.long())
        blocks = block_tables[request_index, positions_t // self.page_size].long()
        slot_mapping = blocks * self.page_size + positions_t % self.page_size
        md = AttentionMetadata(
            slot_mapping=slot_mapping.to(device), block_tables=block_tables.to(device),
            cu_seqlens_q=cu_seqlens_q.to(device), seqlens_k=torch.tensor(seqlens_k, dtype=torch.int32).to(device),
            max_seqlen_q=max(q_lens), page_size=self.page_size, k_caches=self.kv_cache.k, v_caches=self.kv_cache.v,
            use_triton=self.use_triton)
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        logits_idx = torch.tensor(logits_indices, dtype=torch.int64, device=device)
        return input_ids, positions_t.to(device), md, logits_idx
