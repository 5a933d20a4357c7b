"""The engine's front: requests in, finished outputs out, one scheduled forward pass per ``step``."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

import torch

from cbrun.engine.config import EngineConfig
from cbrun.engine.core.block_manager import BlockManager, truncated_block_hash
from cbrun.engine.core.cache_sizing import max_prompt_logprob_rows, resolve_num_blocks
from cbrun.engine.core.cache_spec import CacheSpec
from cbrun.engine.core.kv_layout import KVLayout, ModelConfig, text_config
from cbrun.engine.core.plan import SchedulerOutput
from cbrun.engine.core.request import Request, RequestStatus
from cbrun.engine.core.request_checks import request_error
from cbrun.engine.core.scheduler import SCHEDULERS
from cbrun.engine.core.stats import EngineStats
from cbrun.engine.core.stop_strings import StopStringMatcher
from cbrun.engine.model import loader
from cbrun.engine.model.model_impl import select_lean_model
from cbrun.engine.outputs import RequestOutput, request_output
from cbrun.engine.sample.step import StepHandle, StepSampler
from cbrun.engine.sampling_params import SamplingParams
from cbrun.engine.spec_decode.draft_proposer import DraftProposer, draft_bytes_per_block
from cbrun.engine.structured_output.bitmask import StepBitmask
from cbrun.engine.structured_output.compiler import GrammarCompiler
from cbrun.engine.structured_output.request_state import StructuredOutputRequest
from cbrun.engine.structured_output.schema_support import constraint_backend
from cbrun.engine.worker import backends, tp_group
from cbrun.engine.worker.async_batching import use_async_batching
from cbrun.engine.worker.device import select_device
from cbrun.engine.worker.kv_cache import KVCache, kv_cache_dtype
from cbrun.engine.worker.model_runner import ModelRunner
from cbrun.engine.worker.threads import resolve_attention_threads
from cbrun.engine.worker.tp_worker import local_cache_shape


@dataclass(frozen=True)
class _KVEntry:
    """What one KV cache block holds on this rank (``LLMEngine._kv_entry``).

    Attributes:
        num_kv_heads: KV heads this rank's cache holds (its share under tensor parallelism).
        head_dim: the size of one head.
        cache_dtype: the cache's dtype (``kv_cache_dtype``).
        model_dtype: the model's parameters' dtype.
        bytes_per_block: bytes of one block on this rank, the draft model's cache included.
        ranks_per_memory: ranks whose caches share one memory (on the CPU, the host's).
    """

    num_kv_heads: int
    head_dim: int
    cache_dtype: torch.dtype
    model_dtype: torch.dtype
    bytes_per_block: int
    ranks_per_memory: int


@dataclass(frozen=True)
class _Kernels:
    """The kernels and graphs an engine runs, chosen once from its config (``cbrun.engine.worker.backends``).

    Attributes:
        triton: attention runs the Triton kernels.
        cuda_graphs: decode steps replay from CUDA graphs, real or emulated.
        cpu_kernel: attention runs the C CPU kernel.
        batch_invariant: the batch-invariant forward runs.
    """

    triton: bool
    cuda_graphs: bool
    cpu_kernel: bool
    batch_invariant: bool

    @classmethod
    def choose(cls, config: EngineConfig, dtype: torch.dtype, model_config: ModelConfig) -> "_Kernels":
        """The choice for ``config``, a model of ``dtype`` and its text config.

        Raises:
            ValueError: a setting of "on" that cannot run here (CUDA graphs, ``batch_invariant``), naming why.
        """
        triton = backends.use_triton(config)
        cuda_graphs = backends.use_cuda_graphs(config, triton, model_config)
        cpu_kernel = backends.use_cpu_kernel(config, dtype, triton)
        invariant = backends.use_batch_invariant(config, cpu_kernel, cuda_graphs, triton, dtype)
        return cls(triton, cuda_graphs, cpu_kernel, invariant)


class LLMEngine:
    """Continuous batching over one causal LM: iteration-level scheduling, paged KV cache, chunked prefill.

    Each ``step`` asks the scheduler for a plan, has the model runner execute it, samples, and returns the
    requests that finished. A finished request frees its blocks at once and a waiting one takes them at the next
    step (Orca, Yu et al. OSDI 2022; vLLM, Kwon et al. SOSP 2023).

    Build it with ``from_pretrained``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        tokenizer=None,
        expected_requests: int | None = None,
        expected_tokens: int | None = None,
        draft_model: torch.nn.Module | None = None,
        tensor_parallel: tp_group.TensorParallelGroup | None = None,
    ) -> None:
        self.config = config
        #: Rank 0's handle on the other ranks of a tensor-parallel replica (``tensor_parallel_size > 1``), or None.
        self.tp_group = tensor_parallel
        select_device(config.device)
        self.tokenizer = tokenizer
        self._stop_matcher = StopStringMatcher(tokenizer) if tokenizer is not None else None
        self.model = model
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = max_model_len
        #: The model's text config (a multimodal config's language part), read by attribute.
        self.model_config: ModelConfig = text_config(model)
        layout = KVLayout.from_model_config(self.model_config)
        backends.check_speculative(config, layout)
        entry = self._kv_entry(layout, draft_model)
        #: The cache's geometry, the one source for the block manager, the KV cache, padding and the runner.
        self.cache_spec = self._plan_cache(entry, layout, expected_requests, expected_tokens)
        self.block_manager = BlockManager(
            self.cache_spec, config.allow_block_sharing, truncated_block_hash(config.prefix_hash_bits)
        )
        self.scheduler = SCHEDULERS[config.scheduler_type](
            config,
            self.block_manager,
            max_model_len,
            self.eos_token_ids,
            self._stop_matcher,
            max_prompt_logprob_rows(config, self.model_config.vocab_size),
        )
        kernels = _Kernels.choose(config, entry.model_dtype, self.model_config)
        #: Launch step N+1 before reading step N's tokens (async batching). On the CPU nothing overlaps, but the
        #: same bookkeeping runs when this is set by hand, which is how the tests check it.
        self.overlap_steps = use_async_batching(
            config.async_batching, config.device, kernels.cuda_graphs, config.speculative
        )
        self.model_runner = self._model_runner(entry, kernels)
        #: Runs the draft model and fills each step's proposals (``speculative = "draft"``); its cache shares
        #: the block manager's block ids.
        self.drafter = self._drafter(draft_model, kernels.triton)
        self._init_step_state()

    def _init_step_state(self) -> None:
        """The state the step loop keeps between steps, and the hooks a caller may set on it."""
        self._draft_probs: dict[int, torch.Tensor] = {}  # this step's draft distributions of sampled requests
        self._counters = EngineStats()  # the engine's own counters; ``stats`` adds those its parts own
        #: The step in flight (async batching): its plan, handle and grammar bitmask (or None).
        self._in_flight: tuple[SchedulerOutput, StepHandle, StepBitmask | None] | None = None
        self._seed_generator = torch.Generator().manual_seed(self.config.seed)
        #: Called by ``step`` with the request ids of the plan it launches (None: nothing is called). Lets a caller
        #: see which requests share a forward pass, e.g. a Ray replica serving several batches at once.
        self.step_observer: Callable[[list], None] | None = None
        #: Called at the end of each ``step`` with the batch tokens of the plan it launched (0: none) and the step's
        #: wall seconds (None: nothing is called). Lets a job record its timeline (``cbrun.jobs.observe.timeline``).
        self.step_listener: Callable[[int, float], None] | None = None
        self._grammar_compiler: GrammarCompiler | None = None  # built for the first constrained request
        self._grammar_thread: ThreadPoolExecutor | None = None  # fills a step's masks beside its forward pass

    def _kv_entry(self, layout: KVLayout, draft_model: torch.nn.Module | None) -> _KVEntry:
        """What one KV cache block holds on this rank and what it costs (the draft model's cache included).

        Raises:
            ValueError: an unknown ``kv_cache_dtype``; ``speculative = "draft"`` without a draft model.
        """
        config, page_size = self.config, self.config.limits.page_size
        num_kv_heads, head_dim = loader.kv_shape(self.model_config)
        model_dtype = next(self.model.parameters()).dtype
        cache_dtype = kv_cache_dtype(config.kv_cache_dtype, model_dtype)
        bytes_per_block = KVCache.bytes_per_block(
            len(layout.layer_types), page_size, num_kv_heads, head_dim, cache_dtype
        )
        ranks_per_memory = 1
        if self.tp_group is not None:  # this rank's KV heads; on the CPU the ranks share the host's memory
            num_kv_heads, head_dim, bytes_per_block = local_cache_shape(self.model, self.tp_group, page_size)  # type: ignore[arg-type]  # a sharded model is a LeanModel (tp_group.start loads only those)
            ranks_per_memory = self.tp_group.ranks_per_memory
        if config.speculative == "draft":
            if draft_model is None:
                raise ValueError('speculative = "draft" needs a draft model (engine.draft_model)')
            bytes_per_block += draft_bytes_per_block(draft_model, page_size)  # one budget for both caches
        return _KVEntry(num_kv_heads, head_dim, cache_dtype, model_dtype, bytes_per_block, ranks_per_memory)

    def _plan_cache(
        self, entry: _KVEntry, layout: KVLayout, expected_requests: int | None, expected_tokens: int | None
    ) -> CacheSpec:
        """How many blocks the cache holds (``num_blocks``: the fewest any rank's memory holds) and its geometry,
        shared with the other ranks of a tensor-parallel replica."""
        config = self.config
        self.num_blocks = resolve_num_blocks(
            config,
            self.max_model_len,
            entry.bytes_per_block * entry.ranks_per_memory,
            self.model_config,
            expected_requests,
            expected_tokens,
        )
        if self.tp_group is not None:  # the fewest blocks any rank's memory holds
            self.num_blocks = self.tp_group.agree_num_blocks(self.num_blocks)
        cache_spec = CacheSpec.build(
            self.num_blocks,
            config.limits.page_size,
            layout,
            num_cpu_blocks=int(config.cpu_offload_space * 2**30)
            // (entry.bytes_per_block * config.tensor_parallel_size),
            max_chunk_tokens=config.limits.max_batch_tokens,
            max_model_len=self.max_model_len,
        )
        if self.tp_group is not None:
            self.tp_group.share_cache_spec(cache_spec)
        return cache_spec

    def _model_runner(self, entry: _KVEntry, kernels: _Kernels) -> ModelRunner:
        """The model runner over a new KV cache, with the lean forward pass (if one runs) and the step's sampler
        (``self.sampler``: it turns each step's logits into its ``StepOutput`` on their device and owns the
        penalised requests' token counts)."""
        config, model, limits = self.config, self.model, self.config.limits
        device = next(model.parameters()).device
        kv_cache = KVCache(
            self.cache_spec,
            entry.num_kv_heads,
            entry.head_dim,
            entry.cache_dtype,
            device,
            num_zeroed_pages=self._num_touched_pages(),
        )
        lean_model = select_lean_model(
            config.model_impl,
            model,
            kernels.cuda_graphs,
            self.max_model_len,
            config.linear_backend,
            kernels.batch_invariant,
            backends.invariant_kernels(config, kernels.cpu_kernel, entry.model_dtype)
            if kernels.batch_invariant
            else None,
            config.fp8_activation_scheme,
        )
        # NOTE: off the CPU a batch-invariant step samples each row alone (StepSampler's docstring says why).
        rows_alone = kernels.batch_invariant and device.type != "cpu"
        self.sampler = StepSampler(self.model_config.vocab_size, device, self.eos_token_ids, rows_alone)
        return ModelRunner(
            model,
            kv_cache,
            use_triton=kernels.triton,
            use_cpu_kernel=kernels.cpu_kernel,
            cpu_kernel_threads=resolve_attention_threads(config.num_threads, config.device),
            graph_buckets=backends.graph_buckets(config, self.max_model_len) if kernels.cuda_graphs else None,
            emulate_graphs=config.cuda_graphs == "emulate",
            max_model_len=self.max_model_len,
            async_batching=self.overlap_steps,
            lean_model=lean_model,
            max_requests=limits.max_requests_per_batch,
            max_batch_tokens=limits.max_batch_tokens,
            sampler=self.sampler,
        )

    def _drafter(self, draft_model: torch.nn.Module | None, use_triton: bool) -> DraftProposer | None:
        """The draft model's proposer (``speculative = "draft"``, which came with a draft model: ``_kv_entry``
        refuses it otherwise), or None."""
        config = self.config
        if config.speculative != "draft" or draft_model is None:
            return None
        return DraftProposer(
            draft_model,
            self.cache_spec,
            self.model_config.vocab_size,
            self.eos_token_ids,
            use_triton,
            self.max_model_len,
            select_lean_model(config.model_impl, draft_model, False, self.max_model_len, config.linear_backend),
        )

    @property
    def stats(self) -> EngineStats:
        """The engine's counters, with soft resets, offloads and generated tokens read from the scheduler and
        evictions from the block manager (their owners)."""
        speculator = self.scheduler.speculator
        spec = (
            dict(
                num_proposed_tokens=speculator.num_proposed_tokens,
                num_accepted_tokens=speculator.num_accepted_tokens,
                num_verify_steps=speculator.num_verify_steps,
            )
            if speculator is not None
            else {}
        )
        compile_seconds = self._grammar_compiler.compile_seconds if self._grammar_compiler is not None else 0.0
        captures, replays = self.model_runner.graph_counts
        return replace(
            self._counters,
            num_cuda_graph_captures=captures,
            num_cuda_graph_replays=replays,
            num_soft_resets=self.scheduler.num_soft_resets,
            grammar_compile_seconds=compile_seconds,
            num_offloads=self.scheduler.num_offloads,
            num_generated_tokens=self.scheduler.num_generated_tokens,
            num_evicted_blocks=self.block_manager.num_evicted_blocks,
            **spec,
        )

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        config: EngineConfig | None = None,
        *,
        expected_requests: int | None = None,
        expected_tokens: int | None = None,
    ) -> "LLMEngine":
        """Load a causal LM from a local directory and build an engine around it.

        A Llama-family checkpoint in safetensors that the lean forward pass runs is read straight from its files,
        without importing transformers (``cbrun.engine.model.safetensors_loader``, ``cbrun.engine.core.tokenizer``), unless
        ``config.loader = "transformers"`` or the engine needs transformers' modules (``model_impl =
        "transformers"``, CUDA graphs, a draft model); everything else loads through transformers. The log says
        which loader ran and why (logger "cbrun.engine", INFO).

        Args:
            model_path: a directory with config.json and weights (nothing is downloaded).
            config: engine settings; defaults to ``EngineConfig()``. ``num_threads = "auto"`` is resolved here,
                from the loaded model's parameter count (``cbrun.engine.worker.threads.resolve_num_threads``).
            expected_requests: how many requests the caller will add in all, when known (a job: its rows to do
                times ``n``). Caps the default KV cache (``num_blocks`` unset) at what that many requests can fill.
            expected_tokens: the sum over those requests of prompt plus ``max_new_tokens``, when known. Caps the
                default KV cache further (``cbrun.engine.core.cache_sizing.resolve_num_blocks``).

        Raises:
            OSError: when the directory is missing or unreadable.
            ValueError: when the model type is not a decoder-only causal LM transformers can load.
            RuntimeError: a tensor's shape does not match config.json (safetensors loader).
            safetensors.SafetensorError: a corrupt or truncated safetensors file.
        """
        config = loader.resolve_engine_dtype(model_path, config or EngineConfig())
        group = None
        if config.tensor_parallel_size > 1:
            config = tp_group.per_rank_config(config)
            plan = loader.tensor_parallel_plan(model_path, config)  # refuses by name before any rank starts
            group = tp_group.start(model_path, config)
        try:
            model = loader.load_model(model_path, config, group.shard(plan.config) if group else None)
            return cls._build(model_path, model, config, group, expected_requests, expected_tokens)
        except BaseException:
            if group is not None:
                group.close()
            raise

    @classmethod
    def _build(cls, model_path, model, config, group, expected_requests, expected_tokens) -> "LLMEngine":
        """``from_pretrained``'s engine around a loaded model (rank 0's shard under tensor parallelism)."""
        tokenizer = loader.load_tokenizer_or_none(model_path, config.loader)
        max_model_len = loader.model_max_len(model.config)
        draft_model = None
        if config.speculative == "draft":
            draft_model = loader.load_draft_model(config, model, tokenizer, max_model_len)
        return cls(
            model,
            config,
            loader.eos_token_ids(model_path, model.config),
            max_model_len,
            tokenizer,
            expected_requests=expected_requests,
            expected_tokens=expected_tokens,
            draft_model=draft_model,
            tensor_parallel=group,
        )

    def close(self) -> None:
        """End the other ranks of a tensor-parallel replica and the grammar thread, if any. The engine cannot
        step afterwards."""
        if self.tp_group is not None:
            self.tp_group.close()
        if self._grammar_thread is not None:
            self._grammar_thread.shutdown()

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(
        self, request_id, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None
    ) -> None:
        """Queue a request. A request that cannot run comes back failed from the next ``step``; nothing raises."""
        params = sampling_params or SamplingParams()
        seed = (
            params.seed
            if params.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self._seed_generator))
        )
        request = Request(request_id, list(prompt_token_ids), params, seed=seed)
        vocab = self.model_config.vocab_size
        error = request_error(request, vocab, self.max_model_len, self._stop_matcher is not None)
        if error is None and params.structured_outputs is not None:
            error = self._start_grammar(request)
        self.scheduler.add_request(request, error=error)

    def _start_grammar(self, request: Request) -> str | None:
        """Give a constrained request its grammar state, its grammar compiling off the step loop (or cached);
        the reason it cannot have one, else None."""
        if self.tokenizer is None:
            return "structured outputs need a tokenizer, and the model directory has none"
        if not self.eos_token_ids:
            return "structured outputs need an EOS token to end the output, and the model states none"
        params = request.sampling_params.structured_outputs
        assert params is not None  # ``add_request`` starts a grammar only for a constrained request
        try:
            backend = constraint_backend(params, self.config)
        except ValueError as exc:  # a keyword the allowed engines would not enforce, by name and path
            return f"structured outputs: {exc}"
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer,
                self.model_config.vocab_size,
                self.eos_token_ids,
                ignore_formats=self.config.structured_outputs_ignore_formats,
            )
        request.structured = StructuredOutputRequest(params, self._grammar_compiler.submit(params, backend))
        return None

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    # ---- stepping -----------------------------------------------------------------------------------------------
    def _num_touched_pages(self) -> int:
        """Cache pages the block manager has handed out at least once (the padding pages included)."""
        return self.block_manager.pool.num_touched_chunks * self.cache_spec.chunk_pages

    def step(self) -> list[RequestOutput]:
        """Plan and launch one forward pass; return the requests that finished (failed ones included).

        Synchronous by default: the step's tokens are read before it returns. With ``overlap_steps`` the step is
        left in flight and the previous one is read instead, after this one was launched (async batching).
        """
        if self.step_listener is None:
            return self._step()
        start = time.perf_counter()
        plan_tokens: list[int] = []
        outputs = self._step(plan_tokens)
        self.step_listener(plan_tokens[0] if plan_tokens else 0, time.perf_counter() - start)
        return outputs

    def _step(self, plan_tokens: list[int] | None = None) -> list[RequestOutput]:
        """``step``'s work; appends the launched plan's batch tokens to ``plan_tokens`` when given."""
        plan = self.scheduler.schedule()
        self.sampler.add_requests(plan.new_sampling)  # sent once: the sampler keeps them until they finish
        finished = self.scheduler.pop_finished()
        if not plan.scheduled and self._in_flight is None and not finished:
            self._wait_for_grammars()
        self.model_runner.kv_cache.zero_pages_below(self._num_touched_pages())  # pages this plan uses first
        if self.drafter is not None and plan.scheduled:
            self.drafter.zero_chunks_below(self.block_manager.pool.num_touched_chunks)
            plan, self._draft_probs = self.drafter.propose(plan, self.sampler.values)
        if self.step_observer is not None and plan.scheduled:
            self.step_observer([s.request_id for s in plan.scheduled])
        if self.tp_group is not None:  # every rank executes the plan on its slice of the cache (and samples nothing)
            self.tp_group.send_step(replace(plan, new_sampling={}), self._num_touched_pages())
        pending_grammar = None
        if self._grammar_compiler is not None and plan.scheduled:  # applied at launch, with every other row
            pending_grammar = self._start_grammar_bitmask(plan)
        previous = self._in_flight[1] if self._in_flight else None
        try:
            handle = self.model_runner.launch(plan, previous, self._draft_probs, pending_grammar)
        finally:  # NOTE: a fill never outlives its step, even a failed one (its matchers are the scheduler's after)
            if isinstance(pending_grammar, Future):
                wait([pending_grammar])
        grammar = pending_grammar.result() if isinstance(pending_grammar, Future) else pending_grammar
        if handle is not None:
            self.scheduler.advance(plan)
        launched = (plan, handle, grammar) if handle is not None else None
        if plan_tokens is not None and handle is not None:
            plan_tokens.append(plan.num_batch_tokens)
        if self.overlap_steps:  # read the step launched before this one; this one stays in flight
            to_read, self._in_flight = self._in_flight, launched
        else:
            to_read = launched
        if to_read is not None:
            # NOTE: read and applied here, not in a helper of this module: a step's logits pass from the sampler's
            # StepOutput straight to the scheduler (benchmarks/step_path.py counts the modules on that path)
            read_plan, read_handle, read_grammar = to_read
            output = self.sampler.read(read_plan, read_handle, read_grammar, self._draft_probs)
            finished.extend(self.scheduler.update_from_output(read_plan, output))  # counts the committed tokens
            self._counters.num_steps += 1
            self._counters.num_computed_tokens += read_plan.num_batch_tokens
            finished.extend(self.scheduler.pop_finished())  # requests whose own row failed
        return [self._finish(r) for r in finished]

    def _start_grammar_bitmask(self, plan: SchedulerOutput) -> StepBitmask | Future[StepBitmask | None] | None:
        """The planned step's grammar bitmask, or, when steps are not overlapped (the CPU), a future of it, filled
        on the grammar thread while this thread runs the forward pass; the sampler waits for it after the logits
        (``ModelRunner.launch``). A step's masks depend only on tokens already accepted, never on its logits, so
        the two can run side by side, as SGLang's overlap of the vocabulary mask with the forward pass does.
        With async batching the masks are already filled while the device computes the step before."""
        if self.overlap_steps:
            return self._fill_grammar_bitmask(plan)
        if self._grammar_thread is None:
            # NOTE: one thread, so a step's fill never runs beside another's (a matcher has one writer at a time)
            self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="cbrun-grammar-fill")
        return self._grammar_thread.submit(self._fill_grammar_bitmask, plan)

    def _fill_grammar_bitmask(self, plan: SchedulerOutput) -> StepBitmask | None:
        """The planned step's grammar bitmask (``StepSampler.fill_grammar_bitmask``), its time counted. With a
        step in flight (async batching) the host fills it while the device computes that step."""
        start = time.perf_counter()
        grammar = self.sampler.fill_grammar_bitmask(plan)
        if grammar is not None:
            self._counters.num_grammar_mask_steps += 1
            self._counters.grammar_mask_seconds += time.perf_counter() - start
        return grammar

    def _wait_for_grammars(self, timeout: float = 0.05) -> None:
        """Nothing could run: block briefly until a waiting request's grammar is compiled, instead of spinning."""
        futures = self.scheduler.grammar_futures()
        if futures:
            assert self._grammar_compiler is not None  # a grammar compiles only once the compiler exists
            self._grammar_compiler.wait_any(futures, timeout)

    def _finish(self, request: Request) -> RequestOutput:
        self.sampler.release(request.index)
        counters = self._counters
        counters.num_requests += 1
        if request.status is RequestStatus.FAILED:
            counters.num_failed_requests += 1
        else:
            counters.num_prompt_tokens += request.num_prompt_tokens
            counters.num_cached_prompt_tokens += request.num_cached_tokens
        return request_output(request, self.tokenizer)

    def generate(
        self, requests: Iterable[tuple[object, list[int], SamplingParams]], max_in_flight: int = 1024
    ) -> Iterator[RequestOutput]:
        """Run requests to completion, pulling them lazily, and yield outputs as they finish.

        Args:
            requests: ``(request_id, prompt_token_ids, sampling_params)`` triples; consumed at most
                ``max_in_flight`` ahead of the finished ones, so an endless iterable is fine.
            max_in_flight: bound on queued plus running requests.

        Yields:
            ``RequestOutput`` in finish order. When the caller stops early (or an error escapes), the requests
            still in the engine are aborted, so a reused engine starts clean.
        """
        source = iter(requests)
        in_flight = 0
        try:
            while True:
                for request_id, prompt, params in itertools.islice(source, max(0, max_in_flight - in_flight)):
                    self.add_request(request_id, prompt, params)
                    in_flight += 1
                if not self.has_unfinished_requests():
                    return
                for output in self.step():
                    in_flight -= 1
                    yield output
        finally:
            if self.has_unfinished_requests():
                self.abort_all_requests()

    def abort_all_requests(self) -> int:
        """Drop every queued and running request, freeing its cache; returns how many were dropped."""
        if self._in_flight is not None:  # its results are not needed; its blocks are freed below
            self.scheduler.discard(self._in_flight[0])
        self._in_flight = None
        self.sampler.release_all()
        return len(self.scheduler.abort_all())
