"""The engine's front: requests in, finished outputs out, one scheduled forward pass per ``step``."""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from engine import safetensors_loader
from engine.async_batching import StepHandle, use_async_batching
from engine.attention import ATTN_IMPLEMENTATION, register_with_transformers
from engine.block_manager import BlockManager, truncated_block_hash
from engine.cache_sizing import resolve_num_blocks
from engine.cache_spec import CacheSpec
from engine.config import EngineConfig, checkpoint_dtype
from engine.device import select_device
from engine.draft_proposer import DraftProposer, check_draft_vocab, draft_bytes_per_block
from engine.kv_cache import KVCache
from engine.kv_layout import SLIDING, KVLayout
from engine.lean_llama import select_lean_model
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.padding import GraphBuckets
from engine.plan import SchedulerOutput
from engine.request import Request, RequestStatus
from engine.sampling.step import LaunchedRows, StepSampler, VerifyEntry
from engine.sampling_params import SamplingParams
from engine.scheduler import make_scheduler
from engine.speculative import accept_greedy
from engine.stats import EngineStats
from engine.stop_strings import StopStringMatcher
from engine.structured_output.bitmask import build_step_bitmask, masked_argmax, masked_greedy
from engine.structured_output.compiler import GrammarCompiler
from engine.structured_output.request_state import StructuredOutputRequest
from engine.switches import resolve_switch
from engine.threads import resolve_attention_threads, resolve_num_threads
from engine.tokenizer import load_tokenizer

logger = logging.getLogger("cbrun.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    ) -> None:
        self.config = config
        select_device(config.device)
        self.tokenizer = tokenizer
        self._stop_matcher = StopStringMatcher(tokenizer) if tokenizer is not None else None
        self.model = model
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = max_model_len
        model_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        num_kv_heads, head_dim = _kv_shape(model_config)
        dtype = next(model.parameters()).dtype
        layout = KVLayout.from_model_config(model_config)
        _check_speculative(config, layout)
        bytes_per_block = KVCache.bytes_per_block(
            len(layout.layer_types), config.page_size, num_kv_heads, head_dim, dtype
        )
        if config.speculative == "draft":
            if draft_model is None:
                raise ValueError('speculative = "draft" needs a draft model (engine.draft_model)')
            bytes_per_block += draft_bytes_per_block(draft_model, config.page_size)  # one budget for both caches
        self.num_blocks = resolve_num_blocks(
            config, max_model_len, bytes_per_block, model_config, expected_requests, expected_tokens
        )
        #: The cache's geometry, the one source for the block manager, the KV cache, padding and the runner.
        self.cache_spec = CacheSpec.build(
            self.num_blocks,
            config.page_size,
            layout,
            num_cpu_blocks=int(config.cpu_offload_space * 2**30) // bytes_per_block,
            max_chunk_tokens=config.max_batch_tokens,
            max_model_len=max_model_len,
        )
        self.block_manager = BlockManager(
            self.cache_spec, config.allow_block_sharing, truncated_block_hash(config.prefix_hash_bits)
        )
        self.scheduler = make_scheduler(
            config, self.block_manager, max_model_len, self.eos_token_ids, self._stop_matcher
        )
        kv_cache = KVCache(
            self.cache_spec,
            num_kv_heads,
            head_dim,
            dtype,
            next(model.parameters()).device,
            num_zeroed_pages=self._num_touched_pages(),
        )
        use_triton = _use_triton(config)
        use_graphs = _use_cuda_graphs(config, use_triton)
        #: Launch step N+1 before reading step N's tokens (async batching). On the CPU nothing overlaps, but the
        #: same bookkeeping runs when this is set by hand, which is how the tests check it.
        self.overlap_steps = use_async_batching(config.async_batching, config.device, use_graphs)
        self.model_runner = ModelRunner(
            model,
            kv_cache,
            use_triton=use_triton,
            use_cpu_kernel=_use_cpu_kernel(config, dtype, use_triton),
            cpu_kernel_threads=resolve_attention_threads(config.num_threads, config.device),
            graph_buckets=_graph_buckets(config, max_model_len) if use_graphs else None,
            emulate_graphs=config.cuda_graphs == "emulate",
            max_model_len=max_model_len,
            async_batching=self.overlap_steps,
            lean_model=select_lean_model(config.model_impl, model, use_graphs, max_model_len, config.linear_backend),
            max_requests=config.max_requests_per_batch,
            max_batch_tokens=config.max_batch_tokens,
        )
        #: Runs the draft model and fills each step's proposals (``speculative = "draft"``); its cache shares
        #: the block manager's block ids.
        self.drafter = (
            DraftProposer(
                draft_model,
                self.cache_spec,
                model_config.vocab_size,
                self.eos_token_ids,
                use_triton,
                max_model_len,
                select_lean_model(config.model_impl, draft_model, False, max_model_len, config.linear_backend),
            )
            if config.speculative == "draft"
            else None
        )
        self._draft_probs: dict[int, torch.Tensor] = {}  # this step's draft distributions of sampled requests
        self._counters = EngineStats()  # the engine's own counters; ``stats`` adds those its parts own
        #: The step in flight (async batching): its plan, handle, and rows sampled at launch (or None).
        self._in_flight: tuple[SchedulerOutput, StepHandle, LaunchedRows | None] | None = None
        self._seed_generator = torch.Generator().manual_seed(config.seed)
        #: Turns each step's logits into tokens on their device; owns the penalised requests' token counts.
        self.sampler = StepSampler(
            model_config.vocab_size, next(model.parameters()).device, self.eos_token_ids, self.scheduler.fail_request
        )
        #: Called by ``step`` with the request ids of the plan it launches (None: nothing is called). Lets a caller
        #: see which requests share a forward pass, e.g. a Ray replica serving several batches at once.
        self.step_observer: Callable[[list], None] | None = None
        #: Called at the end of each ``step`` with the batch tokens of the plan it launched (0: none) and the step's
        #: wall seconds (None: nothing is called). Lets a job record its timeline (``jobs.observe.timeline``).
        self.step_listener: Callable[[int, float], None] | None = None
        self._grammar_compiler: GrammarCompiler | None = None  # built for the first constrained request

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
        without importing transformers (``engine.safetensors_loader``, ``engine.tokenizer``), unless
        ``config.loader = "transformers"`` or the engine needs transformers' modules (``model_impl =
        "transformers"``, CUDA graphs, a draft model); everything else loads through transformers. The log says
        which loader ran and why (logger "cbrun.engine", INFO).

        Args:
            model_path: a directory with config.json and weights (nothing is downloaded).
            config: engine settings; defaults to ``EngineConfig()``. ``num_threads = "auto"`` is resolved here,
                from the loaded model's parameter count (``engine.threads.resolve_num_threads``).
            expected_requests: how many requests the caller will add in all, when known (a job: its rows to do
                times ``n``). Caps the default KV cache (``num_blocks`` unset) at what that many requests can fill.
            expected_tokens: the sum over those requests of prompt plus ``max_new_tokens``, when known. Caps the
                default KV cache further (``engine.cache_sizing.resolve_num_blocks``).

        Raises:
            OSError: when the directory is missing or unreadable.
            ValueError: when the model type is not a decoder-only causal LM transformers can load.
            RuntimeError: a tensor's shape does not match config.json (safetensors loader).
            safetensors.SafetensorError: a corrupt or truncated safetensors file.
        """
        config = resolve_engine_dtype(model_path, config or EngineConfig())
        model = load_model(model_path, config)
        tokenizer = _load_tokenizer(model_path, config.loader)
        max_model_len = _max_model_len(model.config)
        draft_model = None
        if config.speculative == "draft":
            draft_model = _load_draft_model(config, model, tokenizer, max_model_len)
        return cls(
            model,
            config,
            eos_token_ids(model_path, model.config),
            max_model_len,
            tokenizer,
            expected_requests=expected_requests,
            expected_tokens=expected_tokens,
            draft_model=draft_model,
        )

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
        error = self._validate(request)
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
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer, self.model.config.get_text_config().vocab_size, self.eos_token_ids
            )
        params = request.sampling_params.structured_outputs
        request.structured = StructuredOutputRequest(params, self._grammar_compiler.submit(params))
        return None

    def _validate(self, request: Request) -> str | None:
        try:
            request.sampling_params.validate()
        except ValueError as e:
            return f"invalid sampling setting: {e}"
        vocab = self.model.config.get_text_config().vocab_size
        if not request.prompt_token_ids:
            return "empty prompt: nothing to condition on"
        if request.num_prompt_tokens >= self.max_model_len:
            return (
                f"prompt has {request.num_prompt_tokens} tokens; the model's maximum length is "
                f"{self.max_model_len}, so no token can be generated"
            )
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            return f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
        if request.sampling_params.stop and self._stop_matcher is None:
            return "stop strings need a tokenizer, and the model directory has none"
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
        finished = self.scheduler.pop_finished()
        if not plan.scheduled and self._in_flight is None and not finished:
            self._wait_for_grammars()
        self.model_runner.kv_cache.zero_pages_below(self._num_touched_pages())  # pages this plan uses first
        if self.drafter is not None and plan.scheduled:
            self.drafter.zero_chunks_below(self.block_manager.pool.num_touched_chunks)
            plan, self._draft_probs = self.drafter.propose(plan, self.scheduler.requests)
        if self.step_observer is not None and plan.scheduled:
            self.step_observer([self.scheduler.requests[s.request_index].request_id for s in plan.scheduled])
        at_launch = self._rows_sampled_at_launch(plan) if plan.scheduled else None
        handle = self.model_runner.launch(
            plan, self._in_flight[1] if self._in_flight else None, at_launch.sample if at_launch is not None else None
        )
        if handle is not None:
            self.scheduler.advance(plan)
        launched = (plan, handle, at_launch) if handle is not None else None
        if plan_tokens is not None and handle is not None:
            plan_tokens.append(plan.num_batch_tokens)
        if self.overlap_steps:  # read the step launched before this one; this one stays in flight
            to_read, self._in_flight = self._in_flight, launched
        else:
            to_read = launched
        if to_read is not None:
            finished.extend(self._resolve(*to_read))
            finished.extend(self.scheduler.pop_finished())  # requests whose own row raised while read
        return [self._finish(r) for r in finished]

    def _wait_for_grammars(self, timeout: float = 0.05) -> None:
        """Nothing could run: block briefly until a waiting request's grammar is compiled, instead of spinning."""
        futures = self.scheduler.grammar_futures()
        if futures:
            self._grammar_compiler.wait_any(futures, timeout)

    def _rows_sampled_at_launch(self, plan: SchedulerOutput) -> LaunchedRows | None:
        """The plan's entries that sample one token through the sampler (not the plain argmax, not a verify
        entry), with their logit rows and sampling rows; None when there are none."""
        if plan.plain_greedy:
            return None
        rows = LaunchedRows(self.sampler)
        row, sample = 0, 0
        for item in plan.scheduled:
            # NOTE: a constrained row is sampled when the step is read, after its bitmask is built from its matcher
            if (
                item.samples
                and item.needs_host_sampling
                and not item.spec_token_ids
                and self.scheduler.requests[item.request_index].structured is None
            ):
                rows.requests.append(self.scheduler.requests[item.request_index])
                rows.logit_rows.append(row + len(item.prompt_logprob_positions))
                rows.sample_rows.append(sample)
            row += len(item.prompt_logprob_positions) + item.num_sample_rows
            sample += item.num_sample_rows
        return rows if rows.requests else None

    def _resolve(self, plan: SchedulerOutput, handle: StepHandle, at_launch: LaunchedRows | None) -> list[Request]:
        """Read a launched step's tokens, finish the rows sampled at launch, verify speculative entries, record
        prompt log-probabilities, and advance the requests."""
        token_ids = handle.token_ids()  # each sampling entry's token (argmax or sampled), in plan order
        if plan.plain_greedy:
            sampled = self._read_greedy(plan, token_ids)
        else:
            sampled = self._read_rows_of_plan(plan, handle, token_ids)
            if at_launch is not None:
                sampled.update(at_launch.read(token_ids, self.scheduler.requests))
        finished = self.scheduler.resolve(plan, sampled)  # counts the committed output tokens
        self._count_step(plan)
        return finished

    def _read_greedy(self, plan: SchedulerOutput, token_ids: list[int]) -> dict[int, int]:
        """A step of plain greedy entries: each sampling entry's token is the device's argmax.

        Returns:
            ``Request.index -> token`` of the unfinished requests.
        """
        requests = self.scheduler.requests
        sampled: dict[int, int] = {}
        sample = 0
        for item in plan.scheduled:
            if item.samples:
                # None once finished (async batching: found finished after this step was planned); token dropped.
                if item.request_index in requests:
                    sampled[item.request_index] = token_ids[sample]
                sample += 1
        return sampled

    def _read_rows_of_plan(
        self, plan: SchedulerOutput, handle: StepHandle, token_ids: list[int]
    ) -> dict[int, int | list[int]]:
        """Any step: batched sampling, prompt log-probabilities and speculative verification where entries need them.

        Verify entries and prompt rows are gathered over the whole plan and handled in one batched call each
        (``engine.sampling.step.StepSampler``), on the logits' device; rows that sample one token were sampled
        at launch and are read by ``_resolve``.

        Returns:
            ``Request.index -> token``, or the tokens a verify step commits, of the unfinished requests.
        """
        sampled: dict[int, int | list[int]] = {}
        bitmask = self._grammar_bitmask(plan, handle.logits)  # fails the requests whose grammar allows nothing
        prompt_rows: list[tuple[Request, int, range]] = []
        to_sample: list[Request] = []  # constrained rows (the others were sampled at launch)
        sample_at: list[int] = []
        to_verify: list[VerifyEntry] = []
        row, sample = 0, 0
        for item in plan.scheduled:
            # None once finished (async batching: found finished after this step was planned); its token is dropped.
            request = self.scheduler.requests.get(item.request_index)
            num_sample_rows = item.num_sample_rows
            positions = item.prompt_logprob_positions
            if request is not None:
                if positions:
                    prompt_rows.append((request, row, positions))
                first = row + len(positions)
                if item.spec_token_ids and item.needs_host_sampling:
                    to_verify.append(
                        VerifyEntry(
                            request, list(item.spec_token_ids), first, self._draft_probs.get(item.request_index)
                        )
                    )
                elif item.spec_token_ids:
                    sampled[item.request_index] = accept_greedy(
                        item.spec_token_ids, token_ids[sample : sample + num_sample_rows]
                    )
                elif item.samples and item.needs_host_sampling and request.structured is not None:
                    to_sample.append(request)
                    sample_at.append(first)
                elif item.samples and item.needs_host_sampling:
                    pass  # sampled when the step was launched (``_rows_sampled_at_launch``)
                elif item.samples:  # plain greedy: the device's argmax
                    sampled[item.request_index] = token_ids[sample]
            row += len(positions) + num_sample_rows
            sample += num_sample_rows
        if prompt_rows:
            _record_prompt_logprobs(prompt_rows, handle.logits)
        sample_mask = None
        if bitmask is not None and to_sample:
            to_sample, sample_at = self._masked_greedy(handle.logits, bitmask, to_sample, sample_at, sampled)
            sample_mask = bitmask[torch.tensor(sample_at, dtype=torch.int64, device=bitmask.device)]
        sampled.update(self.sampler.sample_rows(handle.logits, to_sample, sample_at, sample_mask))
        sampled.update(self.sampler.verify_entries(handle.logits, to_verify, bitmask))
        return sampled

    def _grammar_bitmask(self, plan: SchedulerOutput, logits: torch.Tensor) -> torch.Tensor | None:
        """The step's token bitmask on the logits' device: (N logit rows, ceil(V / 32)) int32, every token allowed
        in unconstrained rows; None when no planned request is constrained. The sampler applies it first, to every
        row in the same pass. A request whose grammar allows no token at all fails here, alone (its tokenizer
        cannot express the constraint's next character)."""
        if self._grammar_compiler is None:
            return None
        start = time.perf_counter()
        step = build_step_bitmask(plan, self.scheduler.requests, logits.shape[0], logits.shape[-1])
        if step is None:
            return None
        for index in step.blocked:
            self.scheduler.fail_request(
                self.scheduler.requests[index],
                "structured outputs: the constraint allows "
                "no token here (the tokenizer cannot express its next character)",
            )
        bitmask = step.bitmask.to(logits.device, non_blocking=True)
        self._counters.num_grammar_mask_steps += 1
        self._counters.grammar_mask_seconds += time.perf_counter() - start
        return bitmask

    @staticmethod
    def _masked_greedy(
        logits: torch.Tensor, bitmask: torch.Tensor, requests: list[Request], rows: list[int], sampled: dict
    ) -> tuple[list[Request], list[int]]:
        """Take the greedy rows whose only processing is their grammar's mask (``masked_greedy``): their token is
        the argmax of their masked logits, all in one batched op (the sampler's own mask op). Returns the other
        rows and their logit rows, for the sampler; a row whose masked logits hold NaN or nothing goes there too,
        so its error is the sampler's."""
        fast = [i for i, request in enumerate(requests) if masked_greedy(request.sampling_params)]
        if not fast:
            return requests, rows
        tokens = masked_argmax(logits, [rows[i] for i in fast], bitmask)
        done = set()
        for i, token in zip(fast, tokens):
            if token is not None:
                sampled[requests[i].index] = token
                done.add(i)
        keep = [i for i in range(len(requests)) if i not in done]
        return [requests[i] for i in keep], [rows[i] for i in keep]

    def _count_step(self, plan) -> None:
        self._counters.num_steps += 1
        self._counters.num_computed_tokens += plan.num_batch_tokens

    def _finish(self, request: Request) -> RequestOutput:
        self.sampler.release(request)
        counters = self._counters
        counters.num_requests += 1
        if request.status is RequestStatus.FAILED:
            counters.num_failed_requests += 1
        else:
            counters.num_prompt_tokens += request.num_prompt_tokens
            counters.num_cached_prompt_tokens += request.num_cached_tokens
        # No TTFT for an echo-only request (max_new_tokens 0): its prompt ran for log-probabilities, no token is output.
        has_tokens = request.first_token_time is not None and request.sampling_params.max_new_tokens > 0
        ttft = request.first_token_time - request.arrival_time if has_tokens else None
        return RequestOutput(
            request.request_id,
            request.prompt_token_ids,
            request.output_token_ids,
            request.finish_reason,
            request.error,
            ttft,
            request.arrival_time,
            request.finish_time or time.perf_counter(),
            stop_reason=request.stop_reason,
            text=self._output_text(request),
            logprobs=request.logprobs if request.sampling_params.logprobs is not None else None,
            prompt_logprobs=(request.prompt_logprobs if request.sampling_params.prompt_logprobs_from else None),
            prompt_greedy=(request.prompt_greedy if request.sampling_params.prompt_logprobs_from else None),
            scheduled_time=request.scheduled_time,
            first_token_time=request.first_token_time if has_tokens else None,
        )

    def _output_text(self, request: Request) -> str | None:
        """The output text when it is not simply the decoded ids: cut before a stop string, or without the text of
        the stop token (EOS or ``stop_token_ids``) that ended the request, as vLLM's detokenizer does, unless
        ``include_stop_str_in_output``. None: decode ``output_token_ids``."""
        if request.output_text is not None or not isinstance(request.stop_reason, int):
            return request.output_text
        if request.sampling_params.include_stop_str_in_output or self.tokenizer is None:
            return None
        return self.tokenizer.decode(request.output_token_ids[:-1], skip_special_tokens=True)

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


def _check_causal_decoder(model: torch.nn.Module) -> None:
    """Refuse models whose attention is not causal: the paged cache serves decoder-only generation only."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; cbrun runs decoder-only causal LMs")
    for name, module in model.named_modules():
        if getattr(module, "is_causal", True) is False:
            raise ValueError(
                f"{type(model).__name__} has bidirectional (non-causal) attention in {name!r}; "
                "cbrun runs decoder-only causal LMs"
            )


def _record_prompt_logprobs(entries: list[tuple[Request, int, range]], logits: torch.Tensor) -> None:
    """Log-probability of each next prompt token, and whether it was the argmax, for every entry of the step in
    one ``log_softmax``. entries: (request, its first row in ``logits``, its prompt positions); logits: (N, V)."""
    rows = torch.tensor(
        [r for _, first, positions in entries for r in range(first, first + len(positions))],
        dtype=torch.int64,
        device=logits.device,
    )
    targets = torch.tensor(
        [
            t
            for request, _, positions in entries
            for t in request.prompt_token_ids[positions.start + 1 : positions.stop + 1]
        ],
        dtype=torch.int64,
        device=logits.device,
    )
    chosen = logits[rows].float()
    logprobs = torch.log_softmax(chosen, dim=-1).gather(1, targets[:, None])[:, 0].tolist()
    greedy = (chosen.argmax(dim=-1) == targets).tolist()
    start = 0
    for request, _, positions in entries:
        end = start + len(positions)
        request.prompt_logprobs.extend(logprobs[start:end])
        request.prompt_greedy.extend(greedy[start:end])
        start = end


def load_model(model_path: str, config: EngineConfig):
    """The causal LM of a local directory as ``LLMEngine.from_pretrained`` loads it, torch's threads set first.

    Read by ``engine.safetensors_loader`` where it applies (a ``LeanModel``, transformers not imported), else by
    transformers with cbrun's attention. ``config.num_threads``: an int is set before loading, "auto" is resolved
    after it from the model's parameter count (``engine.threads.resolve_num_threads``), None leaves torch's.

    Raises:
        as ``LLMEngine.from_pretrained``.
    """
    config = resolve_engine_dtype(model_path, config)
    select_device(config.device)
    if isinstance(config.num_threads, int):
        torch.set_num_threads(config.num_threads)
    model = _load_target_model(model_path, config)
    if config.num_threads == "auto":
        threads = resolve_num_threads("auto", sum(p.numel() for p in model.parameters()), config.device)
        if threads is not None:
            torch.set_num_threads(threads)
    return model


def resolve_engine_dtype(model_path: str, config: EngineConfig) -> EngineConfig:
    """``config`` with ``dtype = "auto"`` replaced by the dtype it means for this checkpoint and device
    (``EngineConfig.resolve_dtype``: config.json's ``dtype`` / ``torch_dtype`` on CUDA, float32 on the CPU)."""
    if config.dtype != "auto":
        return config
    return replace(config, dtype=config.resolve_dtype(checkpoint_dtype(model_path)))


def _load_target_model(model_path: str, config: EngineConfig):
    """The model, read by ``engine.safetensors_loader`` where it applies (a ``LeanModel``), else by transformers."""
    reason = _needs_transformers(config)
    plan = None
    if reason is None:
        plan, reason = safetensors_loader.load_plan(model_path, config.dtype)
    if plan is not None:
        logger.info("model loader: safetensors, without transformers (engine.safetensors_loader)")
        return safetensors_loader.load(plan, config.device)
    logger.info("model loader: transformers (%s)", reason)
    return _load_model(model_path, config)


def _needs_transformers(config: EngineConfig) -> str | None:
    """Why this engine needs transformers' modules whatever the checkpoint (None: the lean pass may run alone)."""
    if config.loader == "transformers":
        return "engine.loader = transformers"
    if config.model_impl == "transformers":
        return "model_impl = transformers runs transformers' modules"
    if config.speculative == "draft":
        return "speculative = draft: the draft model runs beside transformers' target"
    if config.cuda_graphs == "emulate" or (
        config.cuda_graphs != "off" and _cuda_graphs_blocker(config, _use_triton(config)) is None
    ):
        return "CUDA graphs capture transformers' forward pass"
    return None


def _load_model(model_path: str, config: EngineConfig) -> torch.nn.Module:
    """A local transformers causal LM with cbrun's attention, in ``config.dtype`` on ``config.device``."""
    from transformers import AutoModelForCausalLM

    dtype = "auto" if config.dtype == "auto" else _DTYPES[config.dtype]
    register_with_transformers()
    # NOTE: on CUDA the weights are read straight onto the device in ``dtype`` (one device, so no accelerate
    # dispatch): no host copy of the whole model. The CPU keeps transformers' default placement.
    placement = {"device_map": torch.device(config.device)} if torch.device(config.device).type == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True, **placement
    )
    _check_causal_decoder(model)
    return model.to(config.device).eval()


def _load_draft_model(config: EngineConfig, target: torch.nn.Module, tokenizer, max_model_len: int) -> torch.nn.Module:
    """The draft model of ``config.draft_model``, checked against the target.

    Raises:
        OSError: when the directory is missing or unreadable.
        ValueError: for another vocabulary (``check_draft_vocab``) or a shorter maximum length than the target's.
    """
    draft = _load_model(config.draft_model, config)
    check_draft_vocab(
        target.config.get_text_config().vocab_size,
        draft.config.get_text_config().vocab_size,
        tokenizer,
        _load_tokenizer(config.draft_model, config.loader),
    )
    if _max_model_len(draft.config) < max_model_len:
        raise ValueError(
            f"the draft model's maximum length {_max_model_len(draft.config)} is below the target's "
            f"{max_model_len}: it could not propose near the end of long requests"
        )
    return draft


def _load_tokenizer(model_path: str, loader: str = "auto"):
    """The model directory's tokenizer (``engine.tokenizer.load_tokenizer``), or None when it has none (stop
    strings are then unavailable)."""
    try:
        return load_tokenizer(model_path, loader=loader)
    except (OSError, ValueError, TypeError):
        logger.info("no tokenizer in %s: stop strings are unavailable", model_path)
        return None


def _kv_shape(model_config) -> tuple[int, int]:
    num_heads = model_config.num_attention_heads
    num_kv_heads = getattr(model_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // num_heads
    return num_kv_heads, head_dim


def _max_model_len(model_config) -> int:
    text_config = model_config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text_config, name, None)
        if value:
            return int(value)
    raise ValueError("the model config states no maximum length (max_position_embeddings / n_positions)")


def eos_token_ids(model_path: str, model_config) -> set[int]:
    """generation_config.json's ``eos_token_id`` (what transformers' ``GenerationConfig`` reads), else the model
    config's; a missing or unreadable file counts as stating none."""
    try:
        eos = json.loads((Path(model_path) / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        eos = None
    if eos is None:
        eos = model_config.eos_token_id
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(t) for t in eos}


def _use_cuda_graphs(config: EngineConfig, use_triton: bool) -> bool:
    """Whether to replay decode steps from CUDA graphs, real or emulated; says why not, once, when it cannot."""
    if config.cuda_graphs == "emulate":  # on any device and backend
        return True
    return resolve_switch(
        "cuda_graphs", config.cuda_graphs, _cuda_graphs_blocker(config, use_triton), off_log="CUDA graphs off: %s"
    )


def _cuda_graphs_blocker(config: EngineConfig, use_triton: bool) -> str | None:
    """Why CUDA graphs cannot run in this engine, or None when they can."""
    if torch.device(config.device).type != "cuda":
        return f"the device is {config.device}, not CUDA"
    if not use_triton:
        return "attention_backend = torch synchronises with the host, which a graph cannot hold"
    return None


def _graph_buckets(config: EngineConfig, max_model_len: int) -> GraphBuckets:
    """The shapes decode (and, with speculation, uniform verify) steps are graphed at."""
    max_batch_size = min(
        config.cuda_graph_max_batch_size or config.max_requests_per_batch, config.max_requests_per_batch
    )
    max_query_len = 1 + config.num_speculative_tokens if config.speculative != "off" else 1
    return GraphBuckets(max_batch_size, max_query_len, max_model_len, config.page_size)


def _check_speculative(config: EngineConfig, layout: KVLayout) -> None:
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


def _use_cpu_kernel(config: EngineConfig, dtype: torch.dtype, use_triton: bool) -> bool:
    """Whether attention runs ``kernels.cpu_attention``'s C kernel: "cpu", or "auto" off CUDA where it applies.

    Raises:
        ValueError: ``attention_backend = "cpu"`` on a CUDA device, with a dtype other than float32, or where the
            kernel cannot be built (the message says why).
    """
    if use_triton or config.attention_backend == "torch":
        return False
    reason = None
    if torch.device(config.device).type != "cpu":
        reason = f"the device is {config.device}, not the CPU"
    elif dtype != torch.float32:
        reason = f"the model's dtype is {dtype}; the CPU kernel is float32 only"
    else:
        from kernels.cpu_attention import unavailable_reason

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


def _use_triton(config: EngineConfig) -> bool:
    """Whether attention runs the Triton kernels: "auto" on CUDA devices. Not a ``resolve_switch``: "triton" runs
    on any device (on the CPU through Triton's interpreter, as the tests do), so nothing can block it."""
    if config.attention_backend == "auto":
        return torch.device(config.device).type == "cuda"
    return config.attention_backend == "triton"
