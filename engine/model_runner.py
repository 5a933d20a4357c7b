"""The model runner: turns a step's plan into flattened tensors, runs the model, returns logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.async_batching import InputStager, StepHandle
from engine.attention import AttentionMetadata, GroupMetadata
from engine.cache_spec import cdiv, page_address, slot_address
from engine.cuda_graphs import CudaGraphRunner
from engine.kv_cache import KVCache
from engine.kv_layout import FULL, SLIDING
from engine.padding import PaddedShape, PaddingPolicy
from engine.plan import ScheduledRequest, SchedulerOutput


@dataclass
class _StepInputs:
    """One step's inputs on the host, before upload. Token tensors are (T,), request tensors (B,) / (B + 1,)."""

    input_ids: torch.Tensor  # int64
    positions: torch.Tensor  # int64
    cu_seqlens_q: torch.Tensor  # int32
    seqlens_k: torch.Tensor  # int32
    max_seqlen_q: int
    logits_indices: torch.Tensor  # int64 rows of the flattened batch whose logits are computed
    groups: dict[str, GroupMetadata]
    shape: PaddedShape | None
    num_rows: int  # real logit rows
    sample_row_of: dict[int, int]  # Request.index -> index among the sampling entries
    sample_rows: torch.Tensor | None  # logit row of each sampling entry; None when every row samples
    carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (input rows, sampled rows, device tokens)
    needs_host_logits: bool  # prompt log-probabilities or host-side sampling read the logits after the step


class ModelRunner:
    """Executes a plan. Owns the model, the KV-cache tensors and the per-step input tensors; decides nothing.

    The batch is flattened: the scheduled requests' new tokens are laid end to end as one sequence of T tokens
    (no padding), with positions, per-allocator slot mappings and block tables telling attention where each
    request's context lives.

    Args:
        model: a transformers causal LM loaded with ``attn_implementation="cbrun_paged"``.
        kv_cache: the cache tensors; its ``spec`` gives the layout, page size and ring size.
        use_triton: attention through the Triton kernels.
        use_cpu_kernel: attention through ``kernels.cpu_attention`` (pages read in place; not with ``use_triton``).
        padding: pad every step to a ``PaddedShape`` (what CUDA graphs need); None runs exact shapes.
        use_cuda_graphs: replay the forward pass from CUDA graphs (needs ``padding`` and ``use_triton``).
        max_cached_graphs: graphs kept at once.
        max_model_len: the model's maximum length (sizes the static block tables).
        async_batching: steps overlap (the next is launched before this one's results are read): inputs go
            through ``InputStager`` on CUDA, and logits the host still needs are copied out of the graph's output.
        lean_model: a ``LeanLlama`` over ``model`` to run instead of its transformers forward (not with graphs).
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, use_triton: bool = False,
                 use_cpu_kernel: bool = False,
                 padding: PaddingPolicy | None = None,
                 use_cuda_graphs: bool = False, max_cached_graphs: int = 32, max_model_len: int = 0,
                 async_batching: bool = False, lean_model=None) -> None:
        assert not use_cuda_graphs or (padding is not None and use_triton), "CUDA graphs need padding and Triton"
        assert not async_batching or use_cuda_graphs, "async batching needs CUDA graphs"
        assert not (use_cuda_graphs and lean_model is not None), "CUDA graphs capture the transformers forward"
        self.lean_model = lean_model
        self.model = model
        self.kv_cache = kv_cache
        spec = kv_cache.spec
        layout = spec.layout
        self.page_size = spec.page_size
        self.ring_blocks = spec.ring_blocks
        self.use_triton = use_triton
        self.use_cpu_kernel = use_cpu_kernel
        self.padding = padding
        self.use_cuda_graphs = use_cuda_graphs
        self.max_cached_graphs = max_cached_graphs
        self.max_model_len = max_model_len
        self._graph_runner: CudaGraphRunner | None = None
        self.device = next(model.parameters()).device
        self.layer_groups = [(kind, layout.index_in_group(i)) for i, kind in enumerate(layout.layer_types)]
        self.layers_per_block = {kind: spec.layers_per_block(kind) for kind in (FULL, SLIDING)}
        self.async_batching = async_batching
        self.stager = InputStager(self._max_input_elements(), self.device) if async_batching else None

    def _max_input_elements(self) -> int:
        """int64 elements of the largest padded step's inputs (what ``_upload`` stages)."""
        policy = self.padding
        shape = policy.shape(policy.max_batch_tokens, policy.max_requests, self.max_model_len, policy.max_batch_tokens)
        tokens, requests = shape.num_tokens, shape.num_requests
        num_groups = sum(1 for n in self.layers_per_block.values() if n)
        per_group = tokens + requests * shape.num_kv_blocks
        return 2 * tokens + 2 * requests + 1 + 2 * shape.num_logit_rows + num_groups * per_group + 2 * requests

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> torch.Tensor | None:
        """Run a plan synchronously and return its logits (``launch`` without a step in flight).

        Returns:
            (N, vocab_size) logits in plan order: for each entry, one row per ``prompt_logprob_positions``
            position, then its ``num_sample_rows`` rows (one when it samples, 1 + proposals when it verifies
            speculative tokens). None when nothing is scheduled.
        """
        handle = self.launch(plan)
        return handle.logits if handle is not None else None

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput, previous: StepHandle | None = None) -> StepHandle | None:
        """Make the plan's offload copies, then enqueue one forward pass and the argmax of its sample rows.

        Args:
            plan: the step's plan; each entry computes ``num_tokens`` tokens from its ``start``.
            previous: the step still in flight (async batching). An input token that is pending on the host
                (``PENDING_TOKEN``) is taken from ``previous.sampled`` on the device.

        Returns:
            The step's handle (nothing waited for on CUDA), or None when nothing is scheduled.

        Raises:
            RuntimeError: when a pending input token was not sampled by ``previous`` (a scheduler bug).
        """
        if plan.swap_out or plan.swap_in:
            self.kv_cache.swap(plan.swap_out, plan.swap_in)
        if not plan.scheduled:
            return None
        inputs = self._prepare(plan.scheduled, previous)
        input_ids, positions, md, logits_indices, sample_rows, carry = self._upload(inputs)
        if self.use_cuda_graphs:
            if self._graph_runner is None:
                self._graph_runner = self._make_graph_runner(md)
            logits = self._graph_runner.run(input_ids, positions, md, logits_indices, inputs.shape, carry)
            logits = logits[:inputs.num_rows]
            if self.async_batching and inputs.needs_host_logits:  # the next replay overwrites the static output
                logits = logits.clone()
        else:
            if carry is not None:
                input_ids[carry[0]] = carry[1]
            logits = self._forward(input_ids, positions, md, logits_indices)[:inputs.num_rows]
        sample_logits = logits if sample_rows is None else logits[sample_rows]
        sampled = sample_logits.argmax(dim=-1)
        return StepHandle.launch_readback(logits, sampled, inputs.sample_row_of)

    def _forward(self, input_ids, positions, md: AttentionMetadata, logits_indices) -> torch.Tensor:
        """(rows of ``logits_indices``, vocab) logits of one eager forward pass: the lean path or transformers'."""
        if self.lean_model is not None:
            return self.lean_model(input_ids, positions, md, logits_indices)
        output = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                            logits_to_keep=logits_indices, cbrun_metadata=md)
        return output.logits[0]

    def _make_graph_runner(self, template: AttentionMetadata) -> CudaGraphRunner:
        policy = self.padding
        max_shape = policy.shape(policy.max_batch_tokens, policy.max_requests, self.max_model_len,
                                 policy.max_batch_tokens)
        return CudaGraphRunner(self.model, max_shape.num_tokens, max_shape.num_requests, max_shape.num_kv_blocks,
                               max_shape.num_logit_rows, {k: n for k, n in self.layers_per_block.items() if n},
                               template, self.max_cached_graphs)

    def _prepare(self, scheduled: list[ScheduledRequest], previous: StepHandle | None) -> _StepInputs:
        """The step's inputs as host tensors (padded to the step's shape when padding is on)."""
        token_ids, positions, q_lens, seqlens_k, logits_indices = [], [], [], [], []
        carry_dst, carry_src, sample_row_of, sample_rows = [], [], {}, []
        needs_host_logits = False
        offset = 0
        for item in scheduled:
            start, end = item.start, item.end
            token_ids.extend(item.token_ids)
            if item.num_pending_inputs:
                self._carry_pending(item, offset, previous, carry_dst, carry_src)
            positions.extend(range(start, end))
            q_lens.append(item.num_tokens)
            seqlens_k.append(end)
            logprob_positions = item.prompt_logprob_positions
            if logprob_positions:
                logits_indices.extend(range(offset + logprob_positions.start - start,
                                            offset + logprob_positions.stop - start))
            offset += item.num_tokens
            if item.samples:  # one row, or one per verified position (speculative decoding)
                needs_host_logits |= item.needs_host_sampling
                sample_row_of[item.request_index] = len(sample_rows)
                for row in range(offset - item.num_sample_rows, offset):
                    sample_rows.append(len(logits_indices))
                    logits_indices.append(row)
        for dst in carry_dst:
            token_ids[dst] = 0  # a real id for the host copy; the device value replaces it
        num_tokens, num_requests, num_rows = len(token_ids), len(q_lens), len(logits_indices)
        shape = (self.padding.shape(num_tokens, num_requests, max(seqlens_k), num_rows)
                 if self.padding else None)
        if shape is not None:
            # Padded tokens and requests: token 0 at position 0, no query rows, no context, no cache write.
            token_ids += [0] * (shape.num_tokens - num_tokens)
            positions += [0] * (shape.num_tokens - num_tokens)
            q_lens += [0] * (shape.num_requests - num_requests)
            seqlens_k += [0] * (shape.num_requests - num_requests)
            logits_indices += [0] * (shape.num_logit_rows - num_rows)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        cu_seqlens_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(q_lens_t, 0, out=cu_seqlens_q[1:])
        positions_t = torch.tensor(positions, dtype=torch.int64)
        request_index = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t.long())
        max_blocks = shape.num_kv_blocks if shape else cdiv(max(seqlens_k), self.page_size)
        groups = {kind: self._group_metadata(kind, scheduled, positions_t[:num_tokens], request_index, max_blocks,
                                             len(q_lens), len(token_ids))
                  for kind, n in self.layers_per_block.items() if n}
        carry = (torch.tensor(carry_dst, dtype=torch.int64), torch.tensor(carry_src, dtype=torch.int64),
                 previous.sampled) if carry_dst else None
        return _StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64), positions=positions_t, cu_seqlens_q=cu_seqlens_q,
            seqlens_k=torch.tensor(seqlens_k, dtype=torch.int32), max_seqlen_q=max(q_lens),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64), groups=groups, shape=shape,
            num_rows=num_rows, sample_row_of=sample_row_of,
            sample_rows=None if len(sample_rows) == num_rows else torch.tensor(sample_rows, dtype=torch.int64),
            carry=carry, needs_host_logits=needs_host_logits or num_rows > len(sample_rows))

    @staticmethod
    def _carry_pending(item: ScheduledRequest, offset: int, previous: StepHandle | None, carry_dst: list[int],
                       carry_src: list[int]) -> None:
        """Record that the entry's last input (at ``offset + num_tokens - 1``) comes from the device."""
        row = previous.sample_row_of.get(item.request_index) if previous is not None else None
        if row is None or item.num_pending_inputs != 1:
            raise RuntimeError(f"request {item.request_id!r} is scheduled with an input token that the step in "
                               "flight did not sample")
        carry_dst.append(offset + item.num_tokens - 1)
        carry_src.append(row)

    def _upload(self, inputs: _StepInputs):
        """Move the host inputs to the device: through the staging pairs when async, else plain copies.

        Returns:
            (input_ids, positions, AttentionMetadata, logits_indices, sample_rows, carry) on the device;
            ``sample_rows`` is None when every logit row samples, ``carry`` is (input rows, token ids) or None.
        """
        names = list(inputs.groups)
        tensors = [inputs.input_ids, inputs.positions, inputs.cu_seqlens_q, inputs.seqlens_k, inputs.logits_indices]
        for name in names:
            tensors += [inputs.groups[name].slot_mapping, inputs.groups[name].block_tables]
        if inputs.sample_rows is not None:
            tensors.append(inputs.sample_rows)
        if inputs.carry is not None:
            tensors += [inputs.carry[0], inputs.carry[1]]
        if self.stager is not None:
            tensors = self.stager.stage(tensors)
        elif self.device.type != "cpu":
            tensors = [t.to(self.device, non_blocking=True) for t in tensors]
        input_ids, positions, cu_seqlens_q, seqlens_k, logits_indices = tensors[:5]
        groups = {}
        for i, name in enumerate(names):
            slots, tables = tensors[5 + 2 * i:7 + 2 * i]
            groups[name] = GroupMetadata(slot_mapping=slots, block_tables=tables,
                                         layers_per_block=self.layers_per_block[name])
        rest = tensors[5 + 2 * len(names):]
        sample_rows = rest.pop(0) if inputs.sample_rows is not None else None
        carry = (rest[0], inputs.carry[2][rest[1]]) if inputs.carry is not None else None
        md = AttentionMetadata(
            groups=groups, layer_groups=self.layer_groups, cu_seqlens_q=cu_seqlens_q, seqlens_k=seqlens_k,
            max_seqlen_q=inputs.max_seqlen_q, page_size=self.page_size, k_pages=self.kv_cache.k_pages,
            v_pages=self.kv_cache.v_pages, use_triton=self.use_triton, use_cpu_kernel=self.use_cpu_kernel)
        return input_ids, positions, md, logits_indices, sample_rows, carry

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
        tables = [s.block_table if kind == FULL else s.sliding_block_table for s in scheduled]
        width = max(len(t) for t in tables)
        blocks = torch.zeros((num_rows, width), dtype=torch.int64)  # padding rows read reserved chunk 0
        blocks[:len(tables)] = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        if kind == SLIDING:  # logical block j lives in ring block j % ring size
            blocks = blocks[:, (torch.arange(num_logical_blocks) % self.ring_blocks).clamp(max=width - 1)]
        elif num_logical_blocks > width:  # columns past every table (padded shapes) read the padding chunk
            blocks = torch.nn.functional.pad(blocks, (0, num_logical_blocks - width))
        else:
            blocks = blocks[:, :num_logical_blocks]
        pages = page_address(blocks, self.layers_per_block[kind])
        slot_mapping = torch.full((num_slots,), -1, dtype=torch.int64)
        rows = request_index[:len(positions)]
        slot_mapping[:len(positions)] = slot_address(pages[rows, positions // page], positions % page, page)
        return GroupMetadata(slot_mapping=slot_mapping, block_tables=pages.to(torch.int32),
                             layers_per_block=self.layers_per_block[kind])
