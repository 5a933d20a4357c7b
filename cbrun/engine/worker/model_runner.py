"""The model runner: turns a step's plan into flattened tensors, runs the model, returns logits."""

from __future__ import annotations

from concurrent.futures import Future
from typing import NamedTuple

import torch

from cbrun.engine.core.cache_spec import cdiv
from cbrun.engine.core.kv_layout import FULL, SLIDING
from cbrun.engine.core.plan import SchedulerOutput
from cbrun.engine.model.family import LeanForward
from cbrun.engine.model.layers.attention import AttentionMetadata, GroupMetadata
from cbrun.engine.sample.step import StepHandle, StepSampler
from cbrun.engine.structured_output.bitmask import StepBitmask
from cbrun.engine.worker.async_batching import InputStager
from cbrun.engine.worker.cuda_graphs import AttentionSetup, CudaGraphRunner
from cbrun.engine.worker.input_batch import PersistentBatch
from cbrun.engine.worker.kv_cache import KVCache
from cbrun.engine.worker.padding import GraphBuckets
from cbrun.engine.worker.step_inputs import StepInputBuilder, StepInputs


class ModelRunner:
    """Executes a plan. Owns the model, the KV-cache tensors and the per-step input tensors; decides nothing.

    The batch is flattened: the scheduled requests' new tokens are laid end to end as one sequence of T tokens
    (no padding), with positions, per-allocator slot mappings and block tables telling attention where each
    request's context lives. Block tables are kept between steps in a ``PersistentBatch`` that each plan patches
    (``cbrun.engine.worker.input_batch``); positions and slots are computed with array operations from per-request values, so a
    decode step costs no Python object per request beyond reading its plan entry.

    Args:
        model: a transformers causal LM loaded with ``attn_implementation="cbrun_paged"``.
        kv_cache: the cache tensors; its ``spec`` gives the layout, page size and ring size.
        use_triton: attention through the Triton kernels.
        use_cpu_kernel: attention through ``cbrun.kernels.cpu_attention`` (pages read in place; not with ``use_triton``).
        cpu_kernel_threads: that kernel's threads; None uses torch's intra-op count.
        graph_buckets: replay decode and uniform verify steps from CUDA graphs at these padded shapes (real ones
            need ``use_triton``); other steps, and all of them when None, run eagerly at their exact shapes.
        emulate_graphs: emulate the graphs (``cbrun.engine.worker.graph_emulation``) instead of capturing CUDA graphs.
        max_model_len: the model's maximum length (sizes the persistent batch's block tables).
        async_batching: steps overlap (the next is launched before this one's results are read): inputs go
            through ``InputStager`` on CUDA, and logits the host still needs are copied out of the graph's output.
        lean_model: a family's lean forward pass (``LeanForward``) over ``model`` to run instead of its
            transformers forward (not with graphs).
        max_requests: rows the persistent batch allocates at first (more are added if a plan needs them); with
            async batching, the scheduler's request limit.
        max_batch_tokens: the scheduler's token budget (sizes the async input staging).
        sampler: draws the step's rows at launch (``cbrun.engine.sample.step``; the engine reads its
            ``StepOutput`` from it); None samples nothing beyond the argmax (a tensor-parallel rank above 0, a draft
            model's runner).
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
        lean_model: LeanForward | None = None,
        max_requests: int = 64,
        max_batch_tokens: int = 0,
        sampler: StepSampler | None = None,
    ) -> None:
        use_cuda_graphs = graph_buckets is not None
        assert not use_cuda_graphs or use_triton or emulate_graphs, "CUDA graphs need the Triton kernels"
        assert not async_batching or use_cuda_graphs, "async batching needs CUDA graphs"
        assert not (use_cuda_graphs and lean_model is not None), "CUDA graphs capture the transformers forward"
        self.lean_model = lean_model
        self.sampler = sampler
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
        self.step_inputs = StepInputBuilder(
            self.input_batch, self.layers_per_block, self.page_size, self.ring_blocks, graph_buckets
        )

    def _max_input_elements(self, max_requests: int, max_batch_tokens: int) -> int:
        """int64 elements of the largest step's inputs (what ``_upload`` stages): an eager step at the scheduler's
        budgets or the largest graphed shape."""
        assert self.graph_buckets is not None  # async batching runs only with graphs
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
        draft_probs: dict[int, torch.Tensor] | None = None,
        grammar: StepBitmask | Future[StepBitmask | None] | None = None,
    ) -> StepHandle | None:
        """Make the plan's offload copies, then enqueue one forward pass, the argmax of its sample rows (zeros
        when no entry reads it: ``StepInputs.needs_argmax``) and the sampler's work on every other row
        (``StepSampler.launch``: draws, verification, prompt scores), then start the one copy of the step's
        tokens (and those rows' log-probabilities and scores) to the host.

        A row the sampler fails has a negative id (its error code): read back as it is, fed to the next step as 0.

        Args:
            plan: the step's plan; each entry computes ``num_tokens`` tokens from its ``start``.
            previous: the step still in flight (async batching). An input token that is pending on the host
                (``PENDING_TOKEN``) is taken from ``previous.sampled`` on the device.
            draft_probs: the draft distributions of the plan's sampled verify entries, by ``Request.index``
                (they are verified at launch).
            grammar: the step's token bitmask (``StepSampler.fill_grammar_bitmask``), or None; or a future of it,
                waited for once the logits are computed.

        Returns:
            The step's handle (nothing waited for on CUDA), or None when nothing is scheduled. Its results are
            ``StepSampler.read``'s.

        Raises:
            RuntimeError: when a pending input token was not sampled by ``previous`` (a scheduler bug).
        """
        if plan.swap_out or plan.swap_in:
            self.kv_cache.swap(plan.swap_out, plan.swap_in)
        self.input_batch.release(plan.released_request_indices)
        if not plan.scheduled:
            return None
        inputs = self.step_inputs.prepare(plan, previous)
        uploaded = self._upload(inputs)
        logits = self._logits(inputs, uploaded)
        sampled = _device_argmax(inputs, logits, uploaded.sample_rows)
        if self.sampler is None:
            return StepHandle.launch_readback(logits, sampled, plan.layout.sample_index_of)
        if isinstance(grammar, Future):  # filled beside the forward pass (``LLMEngine._start_grammar_bitmask``)
            grammar = grammar.result()
        return self.sampler.launch(plan, logits, sampled, previous, grammar, draft_probs)

    def _logits(self, inputs: StepInputs, uploaded: _DeviceInputs) -> torch.Tensor:
        """(real logit rows, vocab) logits of the step: a graph's replay for a padded step, else an eager forward
        pass (which takes the carried tokens of the step in flight into its input ids first)."""
        input_ids, positions, md, logits_indices, _, carry = uploaded
        if inputs.shape is None:
            if carry is not None:
                input_ids[carry[0]] = carry[1]
            return self._forward(input_ids, positions, md, logits_indices)[: inputs.num_rows]
        if self._graph_runner is None:
            self._graph_runner = self._make_graph_runner()
        logits = self._graph_runner.run(input_ids, positions, md, logits_indices, inputs.shape, carry)
        logits = logits[: inputs.num_rows]
        if self.async_batching and inputs.needs_host_logits:  # the next replay overwrites the static output
            logits = logits.clone()
        return logits

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, logits_indices: torch.Tensor
    ) -> torch.Tensor:
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
        logits: torch.Tensor = output.logits[0]
        return logits

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
        assert self.graph_buckets is not None  # a plan has a graphed shape only with buckets
        return CudaGraphRunner(
            self.model,
            self.graph_buckets,
            {k: n for k, n in self.layers_per_block.items() if n},
            setup,
            emulate=self.emulate_graphs,
        )

    def _upload(self, inputs: StepInputs) -> _DeviceInputs:
        """Move the host inputs to the device: through the staging pairs when async, else plain copies."""
        names = list(inputs.groups)
        tensors = _host_tensors(inputs)
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
        md = self._attention_metadata(groups, cu_seqlens_q, seqlens_k, inputs.max_seqlen_q)
        return _DeviceInputs(input_ids, positions, md, logits_indices, sample_rows, carry)

    def _attention_metadata(
        self, groups: dict[str, GroupMetadata], cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, max_seqlen_q: int
    ) -> AttentionMetadata:
        """The step's attention metadata over the cache's pages, with the runner's kernel choice."""
        return AttentionMetadata(
            groups=groups,
            layer_groups=self.layer_groups,
            cu_seqlens_q=cu_seqlens_q,
            seqlens_k=seqlens_k,
            max_seqlen_q=max_seqlen_q,
            page_size=self.page_size,
            k_pages=self.kv_cache.k_pages,
            v_pages=self.kv_cache.v_pages,
            use_triton=self.use_triton,
            use_cpu_kernel=self.use_cpu_kernel,
            cpu_kernel_threads=self.cpu_kernel_threads,
            # the lean pass asked for it (engine.batch_invariant): every query row attended on its own
            batch_invariant=self.lean_model is not None and self.lean_model.batch_invariant,
        )


class _DeviceInputs(NamedTuple):
    """One step's inputs on the device (``ModelRunner._upload``)."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    md: AttentionMetadata
    logits_indices: torch.Tensor  # (N,) int64
    sample_rows: torch.Tensor | None  # (S,) int64; None when every logit row samples
    carry: tuple[torch.Tensor, torch.Tensor] | None  # (input rows, token ids) taken from the step in flight


def _host_tensors(inputs: StepInputs) -> list[torch.Tensor]:
    """The step's host tensors in the order they are uploaded: the token and request tensors, each group's slot
    mapping and block tables, then the sample rows and the carry's (input rows, sampled rows) where there are
    some."""
    tensors = [inputs.input_ids, inputs.positions, inputs.cu_seqlens_q, inputs.seqlens_k, inputs.logits_indices]
    for group in inputs.groups.values():
        tensors += [group.slot_mapping, group.block_tables]
    if inputs.sample_rows is not None:
        tensors.append(inputs.sample_rows)
    if inputs.carry is not None:
        tensors += [inputs.carry[0], inputs.carry[1]]
    return tensors


def _device_argmax(inputs: StepInputs, logits: torch.Tensor, sample_rows: torch.Tensor | None) -> torch.Tensor:
    """(S,) int64 argmax of the step's sample rows, or zeros when no entry reads it (``StepInputs.needs_argmax``:
    every sampled row is chosen by the sampler, a grammar's masked argmax or verification)."""
    if inputs.needs_argmax:
        sample_logits = logits if sample_rows is None else logits[sample_rows]
        return sample_logits.argmax(dim=-1)
    num_sample_rows = logits.shape[0] if sample_rows is None else sample_rows.shape[0]
    return torch.zeros(num_sample_rows, dtype=torch.int64, device=logits.device)
