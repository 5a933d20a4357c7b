"""The model runner: turns a step's plan into flattened tensors, runs the model, returns logits."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, GroupMetadata
from engine.kv_layout import FULL, SLIDING, KVLayout
from engine.cuda_graphs import CudaGraphRunner
from engine.padding import PaddingPolicy
from engine.scheduler import ScheduledRequest, SchedulerOutput


class KVCache:
    """The paged KV cache and its CPU swap buffer, in pages of one layer's ``page_size`` tokens.

    ``kv`` has shape (2, num_pages, page_size, num_kv_heads, head_dim): K then V, every layer's pages in one
    pool (which page serves which layer is the block manager's business). ``cpu_kv`` is the same with
    ``num_cpu_pages`` (pinned on CUDA), so an offload or restore is one gather and one copy.
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, num_cpu_pages: int = 0) -> None:
        self.kv = torch.zeros((2, num_pages, page_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        pin = torch.device(device).type == "cuda"
        cpu_shape = (2, num_cpu_pages, page_size, num_kv_heads, head_dim)
        self.cpu_kv = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin) if num_cpu_pages else None

    @property
    def k_pages(self) -> torch.Tensor:
        return self.kv[0]

    @property
    def v_pages(self) -> torch.Tensor:
        return self.kv[1]

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """K and V bytes of ``page_size`` tokens across all layers."""
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy ``(device page, CPU slot)`` pairs out, then ``(CPU slot, device page)`` pairs in."""
        if swap_out:
            src, dst = zip(*swap_out)
            self.cpu_kv[:, list(dst)] = self.kv[:, list(src)].to("cpu", non_blocking=True)
        if swap_in:
            src, dst = zip(*swap_in)
            self.kv[:, list(dst)] = self.cpu_kv[:, list(src)].to(self.kv.device, non_blocking=True)


class ModelRunner:
    """Executes a plan. Owns the model, the KV-cache tensors and the per-step input tensors; decides nothing.

    The batch is flattened: the scheduled requests' new tokens are laid end to end as one sequence of T tokens
    (no padding), with positions, per-allocator slot mappings and block tables telling attention where each
    request's context lives.

    Args:
        model: a transformers causal LM loaded with ``attn_implementation="cbrun_paged"``.
        kv_cache: the cache tensors.
        layout: the model's full / sliding layers.
        page_size: tokens per page.
        ring_blocks: sliding blocks per request (0 without sliding layers).
        use_triton: attention through the Triton kernels.
        padding: pad every step to a ``PaddedShape`` (what CUDA graphs need); None runs exact shapes.
        use_cuda_graphs: replay the forward pass from CUDA graphs (needs ``padding`` and ``use_triton``).
        max_cached_graphs: graphs kept at once.
        max_model_len: the model's maximum length (sizes the static block tables).
        lean_model: a ``LeanLlama`` over ``model`` to run instead of its transformers forward (not with graphs).
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, layout: KVLayout, page_size: int,
                 ring_blocks: int = 0, use_triton: bool = False, padding: PaddingPolicy | None = None,
                 use_cuda_graphs: bool = False, max_cached_graphs: int = 32, max_model_len: int = 0,
                 lean_model=None) -> None:
        assert not use_cuda_graphs or (padding is not None and use_triton), "CUDA graphs need padding and Triton"
        assert not (use_cuda_graphs and lean_model is not None), "CUDA graphs capture the transformers forward"
        self.lean_model = lean_model
        self.model = model
        self.kv_cache = kv_cache
        self.layout = layout
        self.page_size = page_size
        self.ring_blocks = ring_blocks
        self.use_triton = use_triton
        self.padding = padding
        self.use_cuda_graphs = use_cuda_graphs
        self.max_cached_graphs = max_cached_graphs
        self.max_model_len = max_model_len
        self._graph_runner: CudaGraphRunner | None = None
        self.device = next(model.parameters()).device
        self.layer_groups = [(kind, layout.index_in_group(i)) for i, kind in enumerate(layout.layer_types)]
        self.layers_per_block = {kind: layout.num_layers_of(kind) for kind in (FULL, SLIDING)}

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
        if not plan.scheduled:
            return None
        input_ids, positions, md, logits_indices, shape = self._prepare(plan.scheduled)
        num_rows = self._num_real_logit_rows(plan.scheduled)
        if self.use_cuda_graphs:
            if self._graph_runner is None:
                self._graph_runner = self._make_graph_runner(md)
            return self._graph_runner.run(input_ids, positions, md, logits_indices, shape)[:num_rows]
        if self.lean_model is not None:
            return self.lean_model(input_ids, positions, md, logits_indices)[:num_rows]
        output = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                            logits_to_keep=logits_indices, cbrun_metadata=md)
        return output.logits[0, :num_rows]

    def _make_graph_runner(self, template: AttentionMetadata) -> CudaGraphRunner:
        policy = self.padding
        max_shape = policy.shape(policy.max_batch_tokens, policy.max_requests, self.max_model_len,
                                 policy.max_batch_tokens)
        return CudaGraphRunner(self.model, max_shape.num_tokens, max_shape.num_requests, max_shape.num_kv_blocks,
                               max_shape.num_logit_rows, {k: n for k, n in self.layers_per_block.items() if n},
                               template, self.max_cached_graphs)

    @staticmethod
    def _num_real_logit_rows(scheduled: list[ScheduledRequest]) -> int:
        return sum(len(s.prompt_logprob_positions()) + s.samples for s in scheduled)

    def _prepare(self, scheduled: list[ScheduledRequest]):
        token_ids, positions, q_lens, seqlens_k, logits_indices = [], [], [], [], []
        offset = 0
        for item in scheduled:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_tokens
            token_ids.extend(request.token_ids(start, end))
            positions.extend(range(start, end))
            q_lens.append(item.num_tokens)
            seqlens_k.append(end)
            logits_indices.extend(offset + p - start for p in item.prompt_logprob_positions())
            offset += item.num_tokens
            if item.samples:
                logits_indices.append(offset - 1)
        num_tokens, num_requests = len(token_ids), len(q_lens)
        shape = (self.padding.shape(num_tokens, num_requests, max(seqlens_k), len(logits_indices))
                 if self.padding else None)
        if shape is not None:
            # Padded tokens and requests: token 0 at position 0, no query rows, no context, no cache write.
            token_ids += [0] * (shape.num_tokens - num_tokens)
            positions += [0] * (shape.num_tokens - num_tokens)
            q_lens += [0] * (shape.num_requests - num_requests)
            seqlens_k += [0] * (shape.num_requests - num_requests)
            logits_indices += [0] * (shape.num_logit_rows - len(logits_indices))
        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        cu_seqlens_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(q_lens_t, 0, out=cu_seqlens_q[1:])
        positions_t = torch.tensor(positions, dtype=torch.int64)
        request_index = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t.long())
        max_blocks = shape.num_kv_blocks if shape else -(-max(seqlens_k) // self.page_size)
        groups = {kind: self._group_metadata(kind, scheduled, positions_t[:num_tokens], request_index, max_blocks,
                                             len(q_lens), len(token_ids))
                  for kind, n in self.layers_per_block.items() if n}
        device = self.device
        md = AttentionMetadata(
            groups=groups, layer_groups=self.layer_groups, cu_seqlens_q=cu_seqlens_q.to(device),
            seqlens_k=torch.tensor(seqlens_k, dtype=torch.int32).to(device), max_seqlen_q=max(q_lens),
            page_size=self.page_size, k_pages=self.kv_cache.k_pages, v_pages=self.kv_cache.v_pages,
            use_triton=self.use_triton)
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        logits_idx = torch.tensor(logits_indices, dtype=torch.int64, device=device)
        return input_ids, positions_t.to(device), md, logits_idx, shape

    def _group_metadata(self, kind: str, scheduled, positions: torch.Tensor, request_index: torch.Tensor,
                        num_logical_blocks: int, num_rows: int, num_slots: int) -> GroupMetadata:
        """Block tables (in pages of the group's first layer) and slot mapping of one allocator's layers.

        Args:
            positions: (T,) positions of the real tokens; request_index: (T,) their row.
            num_logical_blocks: block-table width (covers the longest context, or the padded shape's).
            num_rows: block-table rows (requests, padding included).
            num_slots: slot-mapping length (tokens, padding included); padded tokens get slot -1.
        """
        page = self.page_size
        tables = [s.request.block_table if kind == FULL else s.request.sliding_block_table for s in scheduled]
        width = max(len(t) for t in tables)
        blocks = torch.zeros((num_rows, width), dtype=torch.int64)  # padding rows read reserved chunk 0
        blocks[:len(tables)] = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        logical = torch.arange(num_logical_blocks)
        if kind == SLIDING:  # logical block j lives in ring block j % ring size
            logical = logical % self.ring_blocks
        blocks = blocks[:, logical.clamp(max=width - 1)]
        if kind == FULL:
            blocks[:, width:] = 0  # columns past every table (padded shapes) read the padding chunk
        pages = blocks * self.layers_per_block[kind]
        slot_mapping = torch.full((num_slots,), -1, dtype=torch.int64)
        slot_mapping[:len(positions)] = pages[request_index[:len(positions)], positions // page] * page + positions % page
        return GroupMetadata(slot_mapping=slot_mapping.to(self.device),
                             block_tables=pages.to(torch.int32).to(self.device),
                             layers_per_block=self.layers_per_block[kind])
