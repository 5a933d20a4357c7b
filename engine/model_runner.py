"""The model runner: turns a step's plan into flattened tensors, runs the model, returns logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, compress

import numpy as np
import torch

from engine.async_batching import InputStager, StepHandle
from engine.attention import AttentionMetadata, GroupMetadata
from engine.cache_spec import cdiv, page_address, slot_address
from engine.cuda_graphs import AttentionSetup, CudaGraphRunner
from engine.input_batch import PersistentBatch
from engine.kv_cache import KVCache
from engine.kv_layout import FULL, SLIDING
from engine.padding import GraphBuckets, PaddedShape
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
    shape: PaddedShape | None  # the graph's shape, or None for an eager step
    num_rows: int  # real logit rows
    sample_row_of: dict[int, int]  # Request.index -> index among the sampling entries
    sample_rows: torch.Tensor | None  # logit row of each sampling entry; None when every row samples
    carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (input rows, sampled rows, device tokens)
    needs_host_logits: bool  # prompt log-probabilities or host-side sampling read the logits after the step


class ModelRunner:
    """Executes a plan. Owns the model, the KV-cache tensors and the per-step input tensors; decides nothing.

    The batch is flattened: the scheduled requests' new tokens are laid end to end as one sequence of T tokens
    (no padding), with positions, per-allocator slot mappings and block tables telling attention where each
    request's context lives. Block tables are kept between steps in a ``PersistentBatch`` that each plan patches
    (``engine.input_batch``); positions and slots are computed with array operations from per-request values, so a
    decode step costs no Python object per request beyond reading its plan entry.

    Args:
        model: a transformers causal LM loaded with ``attn_implementation="cbrun_paged"``.
        kv_cache: the cache tensors; its ``spec`` gives the layout, page size and ring size.
        use_triton: attention through the Triton kernels.
        use_cpu_kernel: attention through ``kernels.cpu_attention`` (pages read in place; not with ``use_triton``).
        cpu_kernel_threads: that kernel's threads; None uses torch's intra-op count.
        graph_buckets: replay decode and uniform verify steps from CUDA graphs at these padded shapes (real ones
            need ``use_triton``); other steps, and all of them when None, run eagerly at their exact shapes.
        emulate_graphs: emulate the graphs (``engine.graph_emulation``) instead of capturing CUDA graphs.
        max_model_len: the model's maximum length (sizes the persistent batch's block tables).
        async_batching: steps overlap (the next is launched before this one's results are read): inputs go
            through ``InputStager`` on CUDA, and logits the host still needs are copied out of the graph's output.
        lean_model: a ``LeanLlama`` over ``model`` to run instead of its transformers forward (not with graphs).
        max_requests: rows the persistent batch allocates at first (more are added if a plan needs them); with
            async batching, the scheduler's request limit.
        max_batch_tokens: the scheduler's token budget (sizes the async input staging).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        use_triton: bool = False,
        use_cpu_kernel: bool = False,
        cpu_kernel_threads: int | None = None,
        graph_buckets: GraphBuckets | None = None,
        emulate_graphs: bool = False,
        max_model_len: int = 0,
        async_batching: bool = False,
        lean_model=None,
        max_requests: int = 64,
        max_batch_tokens: int = 0,
    ) -> None:
        use_cuda_graphs = graph_buckets is not None
        assert not use_cuda_graphs or use_triton or emulate_graphs, "CUDA graphs need the Triton kernels"
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
        self.cpu_kernel_threads = cpu_kernel_threads
        self.graph_buckets = graph_buckets
        self.emulate_graphs = emulate_graphs
        self.use_cuda_graphs = use_cuda_graphs
        self.max_model_len = max_model_len
        self._graph_runner: CudaGraphRunner | None = None
        self.device = next(model.parameters()).device
        self.layer_groups = [(kind, layout.index_in_group(i)) for i, kind in enumerate(layout.layer_types)]
        self.layers_per_block = {kind: spec.layers_per_block(kind) for kind in (FULL, SLIDING)}
        self.async_batching = async_batching
        self.stager = (
            InputStager(self._max_input_elements(max_requests, max_batch_tokens), self.device)
            if async_batching
            else None
        )
        groups = [kind for kind, n in self.layers_per_block.items() if n]
        self.input_batch = PersistentBatch(groups, max_requests, cdiv(max_model_len, self.page_size))

    def _max_input_elements(self, max_requests: int, max_batch_tokens: int) -> int:
        """int64 elements of the largest step's inputs (what ``_upload`` stages): an eager step at the scheduler's
        budgets or the largest graphed shape."""
        top = self.graph_buckets.max_shape
        tokens = max(max_batch_tokens, top.num_tokens)
        requests = max(max_requests, top.num_requests)
        num_groups = sum(1 for n in self.layers_per_block.values() if n)
        per_group = tokens + requests * top.num_kv_blocks
        return 4 * tokens + 4 * requests + 1 + num_groups * per_group

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
    def launch(
        self,
        plan: SchedulerOutput,
        previous: StepHandle | None = None,
        sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> StepHandle | None:
        """Make the plan's offload copies, then enqueue one forward pass and the argmax of its sample rows.

        Args:
            plan: the step's plan; each entry computes ``num_tokens`` tokens from its ``start``.
            previous: the step still in flight (async batching). An input token that is pending on the host
                (``PENDING_TOKEN``) is taken from ``previous.sampled`` on the device.
            sample: ``(logits, argmax) -> tokens``: the sampler, called on the device before the tokens are read
                back (it replaces the rows it samples; ``engine.sampling.step``); None keeps the argmax.

        Returns:
            The step's handle (nothing waited for on CUDA), or None when nothing is scheduled.

        Raises:
            RuntimeError: when a pending input token was not sampled by ``previous`` (a scheduler bug).
        """
        if plan.swap_out or plan.swap_in:
            self.kv_cache.swap(plan.swap_out, plan.swap_in)
        self.input_batch.release(plan.released_request_indices)
        if not plan.scheduled:
            return None
        inputs = self._prepare(plan.scheduled, previous, plan.plain_greedy)
        input_ids, positions, md, logits_indices, sample_rows, carry = self._upload(inputs)
        if inputs.shape is not None:
            if self._graph_runner is None:
                self._graph_runner = self._make_graph_runner()
            logits = self._graph_runner.run(input_ids, positions, md, logits_indices, inputs.shape, carry)
            logits = logits[: inputs.num_rows]
            if self.async_batching and inputs.needs_host_logits:  # the next replay overwrites the static output
                logits = logits.clone()
        else:
            if carry is not None:
                input_ids[carry[0]] = carry[1]
            logits = self._forward(input_ids, positions, md, logits_indices)[: inputs.num_rows]
        sample_logits = logits if sample_rows is None else logits[sample_rows]
        sampled = sample_logits.argmax(dim=-1)
        if sample is not None:
            sampled = sample(logits, sampled)
        return StepHandle.launch_readback(logits, sampled, inputs.sample_row_of)

    def _forward(self, input_ids, positions, md: AttentionMetadata, logits_indices) -> torch.Tensor:
        """(rows of ``logits_indices``, vocab) logits of one eager forward pass: the lean path or transformers'."""
        if self.lean_model is not None:
            return self.lean_model(input_ids, positions, md, logits_indices)
        output = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=logits_indices,
            cbrun_metadata=md,
        )
        return output.logits[0]

    @property
    def graph_counts(self) -> tuple[int, int]:
        """(graphs captured, graph replays) so far, emulated or real."""
        runner = self._graph_runner
        return (runner.num_captures, runner.num_replays) if runner is not None else (0, 0)

    def _make_graph_runner(self) -> CudaGraphRunner:
        setup = AttentionSetup(
            self.layer_groups,
            self.page_size,
            self.kv_cache.k_pages,
            self.kv_cache.v_pages,
            self.use_triton,
            self.use_cpu_kernel,
            self.cpu_kernel_threads,
        )
        return CudaGraphRunner(
            self.model,
            self.graph_buckets,
            {k: n for k, n in self.layers_per_block.items() if n},
            setup,
            emulate=self.emulate_graphs,
        )

    def _graph_shape(self, scheduled: list[ScheduledRequest], num_tokens: int, num_rows: int) -> PaddedShape | None:
        """The padded shape of a step that replays a graph, or None when it runs eagerly: graphed are steps where
        every entry has the same number of tokens and samples each of them with no prompt log-probabilities (a
        decode step, or a verify step where every request checks the same number of proposals)."""
        if self.graph_buckets is None or num_rows != num_tokens:
            return None
        query_len = scheduled[0].num_tokens
        if any(
            s.num_tokens != query_len or s.num_sample_rows != query_len or not s.samples or s.prompt_logprob_positions
            for s in scheduled
        ):
            return None
        return self.graph_buckets.shape(len(scheduled), query_len)

    def _prepare(
        self, scheduled: list[ScheduledRequest], previous: StepHandle | None, plain_greedy: bool = False
    ) -> _StepInputs:
        """The step's inputs as host tensors (padded to the step's shape when padding is on).

        ``plain_greedy``: the plan's ``SchedulerOutput.plain_greedy`` (logit rows are then the sampling entries'
        last tokens).

        Per request, only its plan entry's fields are read (a few list comprehensions); everything per token is
        computed with numpy from the per-request starts and lengths, and the block tables are one gather from the
        persistent batch. A decode step (one token per entry, the common step) skips the per-token arrays: its
        positions are the starts and its query offsets a range.
        """
        full = FULL if self.layers_per_block[FULL] else None
        sliding = SLIDING if self.layers_per_block[SLIDING] else None
        num_requests = len(scheduled)
        starts = np.array([s.start for s in scheduled], dtype=np.int64)
        q_lens = [s.num_tokens for s in scheduled]
        num_tokens = sum(q_lens)
        if num_tokens == num_requests:  # a decode step (one token each): positions are the starts
            token_ids = np.array([s.token_ids[0] for s in scheduled], dtype=np.int64)
            cu_seqlens_q = np.arange(num_requests + 1, dtype=np.int64)
            request_of_token = cu_seqlens_q[:-1]
            positions = starts
            seqlens_k = starts + 1
            max_seqlen_q = 1
        else:
            token_ids = np.fromiter(
                chain.from_iterable([s.token_ids for s in scheduled]), dtype=np.int64, count=num_tokens
            )
            q_lens = np.array(q_lens, dtype=np.int64)
            cu_seqlens_q = np.zeros(num_requests + 1, dtype=np.int64)
            np.cumsum(q_lens, out=cu_seqlens_q[1:])
            request_of_token = np.repeat(np.arange(num_requests), q_lens)
            positions = np.arange(num_tokens) + (starts - cu_seqlens_q[:-1])[request_of_token]
            seqlens_k = starts + q_lens
            max_seqlen_q = int(q_lens.max())
        carry = self._carry(scheduled, cu_seqlens_q, previous, token_ids)
        rows, num_blocks, num_sliding = self.input_batch.update(scheduled, full, sliding)
        rows_info = self._logit_rows(scheduled, cu_seqlens_q, plain_greedy)
        logits_indices, sample_rows, sample_row_of, needs_host_logits = rows_info
        num_rows = len(logits_indices)
        max_seqlen_k = int(seqlens_k.max())
        shape = self._graph_shape(scheduled, num_tokens, num_rows)
        if shape is not None:
            # Padded tokens and requests: token 0 at position 0, no query rows, no context, no cache write.
            token_ids = _pad(token_ids, shape.num_tokens)
            positions = _pad(positions, shape.num_tokens)
            cu_seqlens_q = np.concatenate((cu_seqlens_q, np.full(shape.num_requests - num_requests, num_tokens)))
            seqlens_k = _pad(seqlens_k, shape.num_requests)
            logits_indices = _pad(logits_indices, shape.num_logit_rows)
        max_blocks = cdiv(max_seqlen_k, self.page_size)  # a graph's static tables keep their other columns
        num_slots, num_table_rows = len(token_ids), len(seqlens_k)
        groups = {}
        for kind, lengths in ((full, num_blocks), (sliding, num_sliding)):
            if kind is not None:
                groups[kind] = self._group_metadata(
                    kind, rows, lengths, positions[:num_tokens], request_of_token, max_blocks, num_table_rows, num_slots
                )
        return _StepInputs(
            input_ids=torch.from_numpy(token_ids),
            positions=torch.from_numpy(positions),
            cu_seqlens_q=torch.from_numpy(cu_seqlens_q.astype(np.int32)),
            seqlens_k=torch.from_numpy(seqlens_k.astype(np.int32)),
            max_seqlen_q=max_seqlen_q,
            logits_indices=torch.from_numpy(logits_indices),
            groups=groups,
            shape=shape,
            num_rows=num_rows,
            sample_row_of=sample_row_of,
            sample_rows=sample_rows,
            carry=carry,
            needs_host_logits=needs_host_logits,
        )

    @staticmethod
    def _logit_rows(scheduled: list[ScheduledRequest], cu_seqlens_q: np.ndarray, plain_greedy: bool):
        """Which rows of the flattened batch get logits, and which of those are sampled.

        Returns:
            (logits_indices (N,) int64, sample_rows (S,) int64 tensor or None when every logit row samples,
            ``Request.index -> index among the sampling entries``, whether the host reads the logits).
        """
        samples = [s.samples for s in scheduled]
        sampling = list(compress(scheduled, samples)) if not all(samples) else scheduled
        sample_row_of = dict(zip([s.request_index for s in sampling], range(len(sampling))))
        if plain_greedy:  # the common step: one logit row per sampling entry, its last token
            logits_indices = cu_seqlens_q[1:] - 1
            if len(sampling) < len(scheduled):
                logits_indices = logits_indices[np.array(samples, dtype=bool)]
            return logits_indices, None, sample_row_of, False
        needs_host_sampling = any(s.needs_host_sampling for s in sampling)
        if not any([s.prompt_logprob_positions for s in scheduled]):  # e.g. a verify step: every logit row samples
            num_sample_rows = np.array([s.num_sample_rows for s in scheduled], dtype=np.int64)
            first_rows = cu_seqlens_q[1:] - num_sample_rows  # each entry's rows are its last num_sample_rows
            first_of_row = np.repeat(first_rows - (np.cumsum(num_sample_rows) - num_sample_rows), num_sample_rows)
            logits_indices = first_of_row + np.arange(len(first_of_row))
            return logits_indices, None, sample_row_of, needs_host_sampling
        logits_indices, sample_rows = [], []
        for item, offset in zip(scheduled, cu_seqlens_q.tolist()):
            positions = item.prompt_logprob_positions
            if positions:
                logits_indices.extend(
                    range(offset + positions.start - item.start, offset + positions.stop - item.start)
                )
            if item.samples:  # one row, or one per verified position (speculative decoding)
                end = offset + item.num_tokens
                for row in range(end - item.num_sample_rows, end):
                    sample_rows.append(len(logits_indices))
                    logits_indices.append(row)
        num_rows = len(logits_indices)
        return (
            np.array(logits_indices, dtype=np.int64),
            None if len(sample_rows) == num_rows else torch.tensor(sample_rows, dtype=torch.int64),
            sample_row_of,
            needs_host_sampling or num_rows > len(sample_rows),
        )

    def _carry(
        self,
        scheduled: list[ScheduledRequest],
        cu_seqlens_q: np.ndarray,
        previous: StepHandle | None,
        token_ids: np.ndarray,
    ):
        """(input rows, sampled rows, device tokens) of inputs the step in flight sampled (async batching), or None.

        Their host ids (``PENDING_TOKEN``) are set to 0 in ``token_ids``: a real id for the host copy, which the
        device value replaces.
        """
        pending = [i for i, s in enumerate(scheduled) if s.num_pending_inputs]
        if not pending:
            return None
        carry_dst, carry_src = [], []
        for i in pending:
            item = scheduled[i]
            self._carry_pending(item, int(cu_seqlens_q[i]), previous, carry_dst, carry_src)
        token_ids[carry_dst] = 0
        return (
            torch.tensor(carry_dst, dtype=torch.int64),
            torch.tensor(carry_src, dtype=torch.int64),
            previous.sampled,
        )

    @staticmethod
    def _carry_pending(
        item: ScheduledRequest, offset: int, previous: StepHandle | None, carry_dst: list[int], carry_src: list[int]
    ) -> None:
        """Record that the entry's last input (at ``offset + num_tokens - 1``) comes from the device."""
        row = previous.sample_row_of.get(item.request_index) if previous is not None else None
        if row is None or item.num_pending_inputs != 1:
            raise RuntimeError(
                f"request {item.request_id!r} is scheduled with an input token that the step in flight did not sample"
            )
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
            slots, tables = tensors[5 + 2 * i : 7 + 2 * i]
            groups[name] = GroupMetadata(
                slot_mapping=slots, block_tables=tables, layers_per_block=self.layers_per_block[name]
            )
        rest = tensors[5 + 2 * len(names) :]
        sample_rows = rest.pop(0) if inputs.sample_rows is not None else None
        carry = (rest[0], inputs.carry[2][rest[1]]) if inputs.carry is not None else None
        md = AttentionMetadata(
            groups=groups,
            layer_groups=self.layer_groups,
            cu_seqlens_q=cu_seqlens_q,
            seqlens_k=seqlens_k,
            max_seqlen_q=inputs.max_seqlen_q,
            page_size=self.page_size,
            k_pages=self.kv_cache.k_pages,
            v_pages=self.kv_cache.v_pages,
            use_triton=self.use_triton,
            use_cpu_kernel=self.use_cpu_kernel,
            cpu_kernel_threads=self.cpu_kernel_threads,
        )
        return input_ids, positions, md, logits_indices, sample_rows, carry

    def _group_metadata(
        self,
        kind: str,
        rows: np.ndarray,
        lengths: np.ndarray,
        positions: np.ndarray,
        request_of_token: np.ndarray,
        num_logical_blocks: int,
        num_rows: int,
        num_slots: int,
    ) -> GroupMetadata:
        """Block tables (in pages of the group's first layer) and slot mapping of one allocator's layers.

        Args:
            rows: (B,) the scheduled requests' rows in the persistent batch; lengths: (B,) their tables' lengths.
            positions: (T,) positions of the real tokens; request_of_token: (T,) their request (0..B-1).
            num_logical_blocks: block-table width (covers the longest context, or the padded shape's).
            num_rows: block-table rows (requests, padding included; padding rows read reserved chunk 0).
            num_slots: slot-mapping length (tokens, padding included); padded tokens get slot -1.
        """
        page = self.page_size
        width = max(1, int(lengths.max()))
        blocks = self.input_batch.tables[kind].gather(rows, lengths, width)
        if num_rows > len(rows):  # padded requests: no table (column 0 reads the padding chunk)
            blocks = np.concatenate((blocks, np.zeros((num_rows - len(rows), width), dtype=np.int64)))
        if kind == SLIDING:  # logical block j lives in ring block j % ring size
            blocks = blocks[:, np.minimum(np.arange(num_logical_blocks) % self.ring_blocks, width - 1)]
        elif num_logical_blocks > width:  # columns past every table (padded shapes) read the padding chunk
            wide = np.zeros((num_rows, num_logical_blocks), dtype=np.int64)  # (not np.pad: 50x slower)
            wide[:, :width] = blocks
            blocks = wide
        elif num_logical_blocks < width:
            blocks = blocks[:, :num_logical_blocks]
        pages = page_address(blocks, self.layers_per_block[kind])
        block_of_token, offset = np.divmod(positions, page)
        slots = slot_address(pages[request_of_token, block_of_token], offset, page)
        if num_slots == len(slots):
            slot_mapping = slots
        else:
            slot_mapping = np.full(num_slots, -1, dtype=np.int64)
            slot_mapping[: len(slots)] = slots
        return GroupMetadata(
            slot_mapping=torch.from_numpy(slot_mapping),
            block_tables=torch.from_numpy(pages.astype(np.int32)),
            layers_per_block=self.layers_per_block[kind],
        )


def _pad(values: np.ndarray, size: int) -> np.ndarray:
    """``values`` followed by zeros up to ``size``."""
    out = np.zeros(size, dtype=values.dtype)
    out[: len(values)] = values
    return out
