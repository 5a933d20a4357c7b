"""Iteration-level scheduling: which requests run in the next forward pass, and how many tokens each."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from cbrun.engine.config import EngineConfig
from cbrun.engine.core.block_manager import BlockManager
from cbrun.engine.core.cache_spec import cdiv
from cbrun.engine.core.faults import is_request_fault, request_error_message
from cbrun.engine.core.plan import ScheduledRequest, SchedulerOutput, StepOutput
from cbrun.engine.core.plan_builder import PlanBuilder
from cbrun.engine.core.request import Request, RequestStatus
from cbrun.engine.core.stop_check import Stop, StopConditions, check_stop
from cbrun.engine.core.stop_strings import StopStringMatcher
from cbrun.engine.spec_decode.speculative import Speculator


class FIFOScheduler:
    """Decodes first, then running prefills, then new requests in arrival order (transformers' FIFO scheduler).

    Each step is planned under ``max_batch_tokens`` and ``max_requests_per_batch``. A prompt that does not fit the
    remaining budget is split (chunked prefill) and continued in later steps. New requests are admitted only while
    fewer than ``max_requests_per_batch`` run and the free fraction of the block pool is at least
    ``safety_margin`` (or nothing is running).

    Offloading is demand-driven: when a running request cannot get the block it needs next, the newest running
    requests not yet in this step's plan are offloaded, one at a time, until it can; the request asking is never
    offloaded, so the last active request always keeps its cache. An offloaded request is swapped to CPU memory
    when the swap pool has room (resumed later without recomputing) and soft reset otherwise (blocks freed, its
    prompt and generated tokens recomputed on readmission; its seed and token counts are kept). Either way
    it is requeued at the front of ``waiting``.

    The scheduler alone writes a request (the block manager its tables): its status, its tokens
    (``output_token_ids``, ``num_computed_tokens``, ``num_pending_tokens``), their log-probabilities, its prompt
    log-probabilities and its finish fields, and it moves requests between ``waiting`` and ``running``. A step has
    two halves here: ``schedule`` plans it; ``advance`` moves the planned requests past it once it is launched, and
    ``update_from_output`` applies the worker's ``StepOutput`` once it is read, each token through the stop check
    (``cbrun.engine.core.stop_check``), as vLLM v1's ``Scheduler.update_from_output`` does.

    With speculative decoding on (``config.speculative``), a request in steady decode gets proposals
    from its ``Speculator`` and is planned with ``1 + k`` tokens under the same budgets; the scheduler commits the
    accepted tokens one at a time through the stop check and rolls the rejected ones' slots back (``update_from_output``).

    Args:
        config: the engine settings (budgets, safety margin).
        block_manager: the KV-cache bookkeeping it allocates from.
        max_model_len: the model's maximum length; None for no limit.
        eos_token_ids: the model's EOS ids.
        stop_matcher: finds stop strings (None without a tokenizer).
        max_prompt_logprob_rows: most prompt log-probability rows one step may score (the memory budget's charge,
            ``cbrun.engine.core.cache_sizing.max_prompt_logprob_rows``); None bounds them by the token budget only.
    """

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        stop_matcher: StopStringMatcher | None = None,
        max_prompt_logprob_rows: int | None = None,
    ) -> None:
        self.config = config
        self.limits = config.limits  # the budgets, read every step
        self.max_prompt_logprob_rows = max_prompt_logprob_rows
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.stop_conditions = StopConditions(frozenset(eos_token_ids), max_model_len, stop_matcher)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: Unfinished requests (waiting or running) by ``Request.index``.
        self.requests: dict[int, Request] = {}
        self._finished_unplanned: list[Request] = []  # failed or rejected: returned by ``pop_finished``
        self._released: list[int] = []  # ``Request.index`` of requests that left ``running`` since the last plan
        self._verifying: set[int] = set()  # ``Request.index`` of requests whose verify step is launched, not read
        self.num_soft_resets = 0
        self.num_offloads = 0  # swaps to CPU
        #: Output tokens committed (a verify step's accepted run counts only up to a stop inside it, so the count
        #: equals plain decoding's); an echo-only request's token is not an output.
        self.num_generated_tokens = 0
        self.speculator = Speculator(config) if config.speculative != "off" else None

    def add_request(self, request: Request, error: str | None = None) -> None:
        """Queue a request; one with an ``error`` (bad input) fails at once, one with ``max_new_tokens = 0``
        finishes at once (an empty completion, no forward pass) unless it asks for prompt log-probabilities. Either
        comes back from ``pop_finished``."""
        params = request.sampling_params
        if error is not None:
            self._set_failed(request, error)
        elif params.max_new_tokens == 0 and not params.prompt_logprobs_from:
            request.status, request.finish_reason = RequestStatus.FINISHED, "length"
            request.finish_time = time.perf_counter()
            self._finished_unplanned.append(request)
        else:
            request.needs_host_sampling = params.needs_processing
            if request.structured is not None:  # admitted once its grammar is ready; failed if it cannot be
                request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.requests[request.index] = request
            self.waiting.append(request)

    def pop_finished(self) -> list[Request]:
        """The requests that failed or were rejected since the last call (not returned by ``update_from_output``),
        in order."""
        finished, self._finished_unplanned = self._finished_unplanned, []
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._finished_unplanned)

    def abort_all(self) -> list[Request]:
        """Drop every unfinished request, freeing its blocks and swap slots; returns them (status FAILED)."""
        aborted = list(self.running) + list(self.waiting)
        self._released.extend(r.index for r in self.running)
        for request in aborted:
            self.block_manager.free(request)
            if request.cpu_pages:
                self.block_manager.release_swap_slots(request)
            request.status, request.finish_reason, request.error = RequestStatus.FAILED, "error", "aborted"
        self.running.clear()
        self.waiting.clear()
        self.requests.clear()
        self._verifying.clear()
        self._finished_unplanned.clear()
        return aborted

    # ---- planning -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Never raises for a shortage: it preempts, stalls or fails requests instead."""
        plan = PlanBuilder(self.config, self.max_prompt_logprob_rows)
        out = SchedulerOutput()
        self._schedule_phases(plan, out)
        out.scheduled = plan.scheduled
        out.plain_greedy = plan.plain_greedy
        out.new_sampling = plan.new_sampling
        out.released_request_indices, self._released = self._released, []
        return out

    def _schedule_phases(self, plan: PlanBuilder, out: SchedulerOutput) -> None:
        self._schedule_running(plan, out, decodes=True)
        self._schedule_running(plan, out, decodes=False)
        self._schedule_waiting(plan, out)

    def _schedule_running(self, plan: PlanBuilder, out: SchedulerOutput, decodes: bool) -> None:
        """Plan the running requests in steady decode (``decodes``) or with prompt tokens left, in running order.

        This loop runs for every running request every step, so it reads each request only as far as it must.
        """
        speculate = decodes and self.speculator is not None and self.speculator.active(len(self.running))
        status = RequestStatus.DECODING if decodes else RequestStatus.PREFILLING
        # A status never changes between PREFILLING and DECODING while planning, so the other pass (and requests
        # admitted this step, which are PREFILLING and planned) never meet this filter twice.
        for request in [r for r in self.running if r.status is status]:
            if request.status is not status:
                continue  # preempted earlier in this step
            pending = request.num_pending_tokens
            if pending and not self._next_input_ready(request):
                continue
            if plan.request_budget == 0:  # ``plan.fit``, inline: this loop runs per request per step
                return
            num_known = len(request.prompt_token_ids) + len(request.output_token_ids)
            to_compute = num_known + pending - request.num_computed_tokens  # ``Request.num_tokens_to_compute``
            num_tokens = min(to_compute, plan.token_budget)
            if request.sampling_params.prompt_logprobs_from:
                num_tokens = plan.fit_scored(request, request.num_computed_tokens, num_tokens)
            if num_tokens == 0:
                return
            if speculate and to_compute == 1 and not pending and self._schedule_speculative(request, plan, num_known):
                continue
            block_start, sliding_start = len(request.block_table), len(request.sliding_block_table)
            if self.block_manager.allocate_slots(request, num_tokens) or self._allocate_or_preempt(
                request, num_tokens, plan, out
            ):
                plan.add(request, num_tokens, (), block_start, sliding_start)
            elif not plan.scheduled and not self._others_running(request):
                self._fail(request, self._cache_too_small_message(request))

    def _schedule_speculative(self, request: Request, plan: PlanBuilder, num_tokens: int) -> bool:
        """Plan a decode with proposals when the request has some and their slots are free; False otherwise.

        Called for a request in steady decode (its one token to compute is known on the host: nothing pending);
        ``num_tokens`` is its ``Request.num_tokens``. Proposals stop where the request must: the bonus token after
        them may be its last (``max_new_tokens``), and no position reaches the model's length. Their slots never
        preempt anyone: without room, the request decodes plainly.
        """
        room = min(request.sampling_params.max_new_tokens - len(request.output_token_ids) - 1, plan.token_budget - 1)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - num_tokens)
        assert self.speculator is not None  # ``_schedule_running`` speculates only with one
        proposals = self.speculator.propose(request, room)
        block_start, sliding_start = len(request.block_table), len(request.sliding_block_table)
        if not proposals or not self.block_manager.allocate_slots(request, 1 + len(proposals)):
            return False
        plan.add(request, 1 + len(proposals), tuple(proposals), block_start, sliding_start)
        return True

    def grammar_futures(self) -> list[Future[Any]]:
        """The compile futures of the waiting requests whose grammar is not ready (the engine waits on them when
        nothing else can run)."""
        return [
            r.structured.future
            for r in self.waiting
            if r.status is RequestStatus.WAITING_FOR_GRAMMAR and r.structured is not None
        ]

    def _schedule_waiting(self, plan: PlanBuilder, out: SchedulerOutput) -> None:
        """Admit waiting requests in order. One whose grammar is still compiling is stepped over and keeps its
        place (vLLM's WAITING_FOR_FSM): it never holds up the requests behind it."""
        compiling: list[Request] = []
        try:
            self._admit_waiting(plan, out, compiling)
        finally:
            self.waiting.extendleft(reversed(compiling))

    def _grammar_pending(self, request: Request) -> bool:
        """Whether the request still waits for its grammar; a grammar that failed to compile fails it."""
        if request.status is not RequestStatus.WAITING_FOR_GRAMMAR:
            return False
        assert request.structured is not None  # only a constrained request waits for its grammar
        if not request.structured.ready():
            return True
        request.status = RequestStatus.PENDING
        if request.structured.error is not None:
            self.waiting.remove(request)
            self._fail(request, f"structured outputs: {request.structured.error}")
        return False

    def _admit_waiting(self, plan: PlanBuilder, out: SchedulerOutput, compiling: list[Request]) -> None:
        while self.waiting:
            if self.running and self._below_safety_margin():
                return
            # A request beyond what one batch can serve would hold blocks without decoding every step.
            if len(self.running) >= self.limits.max_requests_per_batch:
                return
            request = self.waiting[0]
            if self._grammar_pending(request):
                compiling.append(self.waiting.popleft())
                continue
            if request.is_finished:  # its grammar failed to compile
                continue
            if not self._next_input_ready(request):
                return  # FIFO: its token comes back with the step in flight
            if request.cpu_pages:
                if not self._swap_in(request, plan, out):
                    return
                continue
            if not self.block_manager.can_ever_fit(request.num_tokens):
                self.waiting.popleft()
                self._fail(request, self._cache_too_small_message(request))
                continue
            cached_blocks = self.block_manager.find_cached_prefix(request)
            num_cached_tokens = len(cached_blocks) * self.block_manager.page_size
            num_tokens = plan.fit(request.num_tokens - num_cached_tokens)
            if num_tokens and request.sampling_params.prompt_logprobs_from:
                num_tokens = plan.fit_scored(request, num_cached_tokens, num_tokens)
            if num_tokens == 0:
                return
            if not self.block_manager.allocate_slots(request, num_tokens, cached_blocks):
                return  # FIFO: the head waits for blocks; later arrivals do not overtake it
            self.waiting.popleft()
            request.num_computed_tokens = num_cached_tokens
            if not request.output_token_ids:
                request.num_cached_tokens = num_cached_tokens
            request.status = RequestStatus.PREFILLING
            if request.scheduled_time is None:  # its time in the queue ends at its first admission
                request.scheduled_time = time.perf_counter()
            self.running.append(request)
            plan.add(request, num_tokens)

    def _swap_in(self, request: Request, plan: PlanBuilder, out: SchedulerOutput) -> bool:
        num_tokens = plan.fit_scored(request, request.num_computed_tokens, plan.fit(request.num_tokens_to_compute))
        copies = self.block_manager.swap_in(request, num_tokens) if num_tokens else None
        if copies is None:
            return False
        self.waiting.popleft()
        out.swap_in.extend(copies)
        request.status = RequestStatus.PREFILLING
        self.running.append(request)
        plan.add(request, num_tokens)
        return True

    def _allocate_or_preempt(self, request: Request, num_tokens: int, plan: PlanBuilder, out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate_slots(request, num_tokens):
            victim = self._pick_victim(request, plan)
            if victim is None:
                return False
            self._preempt(victim, out)
            out.num_preempted += 1
        return True

    def _pick_victim(self, request: Request, plan: PlanBuilder) -> Request | None:
        for candidate in reversed(self.running):
            if candidate is not request and not plan.contains(candidate):
                return candidate
        return None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Offload to CPU swap when it has room, else soft reset; requeue at the front either way."""
        self.running.remove(request)
        self._released.append(request.index)
        copies = self.block_manager.swap_out(request) if self.block_manager.swap_pool.enabled else None
        if copies is not None:
            out.swap_out.extend(copies)
            self.num_offloads += 1
        else:
            self.block_manager.free(request)
            request.num_computed_tokens = 0
            self.num_soft_resets += 1
        request.status = RequestStatus.PENDING
        self.waiting.appendleft(request)

    def _next_input_ready(self, request: Request) -> bool:
        """Whether the request may run now. With async batching its last token may still be on the device: it
        runs again only if the model runner can feed that token from the device (the argmax, or a token the
        sampler drew at launch; a penalised row's counts take it from the device too) and that token is not its
        last one (``max_new_tokens`` or the model's length reached). A verify step's tokens never stay
        on the device: how many it commits is known only once it is read."""
        if not request.num_pending_tokens:
            return True
        if request.index in self._verifying:
            return False
        params = request.sampling_params
        if request.structured is not None:  # its next mask needs its matcher past that token, on the host
            return False
        if len(request.output_token_ids) + request.num_pending_tokens >= params.max_new_tokens:
            return False
        return self.max_model_len is None or request.num_tokens < self.max_model_len

    def _others_running(self, request: Request) -> bool:
        return any(r is not request for r in self.running)

    def _below_safety_margin(self) -> bool:
        return self.block_manager.free_fraction < self.limits.safety_margin

    def _cache_too_small_message(self, request: Request) -> str:
        bm = self.block_manager
        needed = cdiv(request.num_tokens + 1, bm.page_size)
        return (
            f"request needs {needed} KV-cache blocks of {bm.page_size} tokens for {request.num_tokens} tokens, "
            f"but the whole cache has {bm.num_blocks}; raise engine.num_blocks or max_memory_percent, "
            f"or shorten the prompt / max_new_tokens"
        )

    # ---- after the forward pass -------------------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Move the planned requests past this step once it is launched, before its tokens are read.

        Each request counts its computed tokens; a request that samples gets one pending token, so the next
        plan can schedule its decode while this step's token is still on the device (async batching).
        """
        requests, decoding = self.requests, RequestStatus.DECODING
        for item in out.scheduled:
            request = requests[item.request_index]
            request.num_computed_tokens += item.num_tokens
            if item.samples:
                request.num_pending_tokens += 1
                request.status = decoding
                if item.spec_token_ids:
                    self._verifying.add(item.request_index)

    def update_from_output(self, out: SchedulerOutput, output: StepOutput) -> list[Request]:
        """Apply a launched step's ``StepOutput``: fail the rows that failed, record prompt log-probabilities, turn
        pending tokens into known ones and finish the requests that stop.

        A verify step (an entry with ``spec_token_ids``) commits its accepted tokens and bonus token one at a
        time, each through the stop check, so a stop inside the run cuts exactly where plain decoding would (the
        log-probabilities are kept for the committed tokens only); the slots of the rejected proposals are rolled
        back (``num_computed_tokens``, and blocks past it freed).

        Args:
            out: the step's plan (already ``advance``d).
            output: the worker's results; every planned request that sampled has tokens or an error.

        Returns:
            The requests that finished (their blocks are already free); those that failed come back from
            ``pop_finished``. A request that finished in an earlier step but was planned again before that was
            known is skipped: its extra token is dropped.
        """
        self.discard(out)
        requests = self.requests
        for index, message in output.errors.items():
            request = requests.get(index)
            if request is not None:
                self.fail_request(request, message)
        for index, (logprobs, greedy) in output.prompt_logprobs.items():
            request = requests.get(index)
            if request is not None:
                request.prompt_logprobs.extend(logprobs)
                request.prompt_greedy.extend(greedy)
        finished = []
        all_logprobs = output.logprobs
        for item in out.scheduled:
            if not item.samples:
                continue
            if item.spec_token_ids:
                self._verifying.discard(item.request_index)
            request = requests.get(item.request_index)
            if request is None:  # finished or failed since this step was planned
                continue
            request.num_pending_tokens -= 1
            tokens = output.token_ids[request.index]
            if item.spec_token_ids:
                self._roll_back_rejected(request, item, num_accepted=len(tokens) - 1)
            if self._commit(request, tokens, all_logprobs.get(request.index) if all_logprobs else None):
                finished.append(request)
            elif item.spec_token_ids and request.status is RequestStatus.DECODING:
                self.block_manager.trim(request)
        return finished

    def _commit(self, request: Request, tokens: list[int], logprobs: list[dict[int, float]] | None) -> bool:
        """Append tokens (and their log-probabilities) one at a time, each through the stop check; True when the
        request finished."""
        counts = request.sampling_params.max_new_tokens > 0
        for i, token in enumerate(tokens):
            if request.structured is not None and counts and not request.structured.accept(token):
                self.fail_request(
                    request,
                    f"structured outputs: token {token} is not allowed by the constraint "
                    "(the sampler's mask was not applied)",
                )
                return False
            request.output_token_ids.append(token)
            if logprobs is not None:
                request.logprobs.append(logprobs[i])
            self.num_generated_tokens += counts
            if request.first_token_time is None:
                request.first_token_time = time.perf_counter()
            try:
                stop = check_stop(request, self.stop_conditions)
            except Exception as error:  # e.g. the tokenizer cannot decode the output for its stop strings
                if not is_request_fault(error):
                    raise
                self.fail_request(request, request_error_message("stop check", error))
                return False
            if stop is not None:
                self._finish(request, stop)
                return True
        return False

    def _roll_back_rejected(self, request: Request, item: ScheduledRequest, num_accepted: int) -> None:
        """Forget the KV of the proposals after the accepted ones: it was computed from rejected tokens."""
        num_proposed = len(item.spec_token_ids)
        request.num_computed_tokens -= num_proposed - num_accepted
        assert self.speculator is not None  # proposals come only from it
        self.speculator.record(request, num_proposed, num_accepted)

    def discard(self, out: SchedulerOutput) -> None:
        """Free the CPU slots a launched plan swapped in from (its copies ran); ``update_from_output`` calls it,
        and the engine for a plan in flight whose results it drops."""
        if out.swap_in:
            self.block_manager.free_swap_slots([slot for slot, _ in out.swap_in])

    def _finish(self, request: Request, stop: Stop) -> None:
        # A request preempted while its last token was in flight may sit in ``waiting`` (even swapped out).
        if request in self.running:
            self.running.remove(request)
            self._released.append(request.index)
        elif request in self.waiting:
            self.waiting.remove(request)
            if request.cpu_pages:
                self.block_manager.release_swap_slots(request)
        self.requests.pop(request.index, None)
        self.block_manager.free(request)
        request.num_pending_tokens = 0  # a token planned after this one is never read
        del request.output_token_ids[stop.num_output_tokens :]  # a stop string cut the output, or an echo-only run
        del request.logprobs[stop.num_output_tokens :]
        request.status = RequestStatus.FINISHED
        request.finish_reason = stop.finish_reason
        request.stop_reason = stop.stop_reason
        request.output_text = stop.output_text
        request.finish_time = time.perf_counter()

    def fail_request(self, request: Request, message: str) -> None:
        """Fail one unfinished request whose own row raised during a step; the others go on.

        Its blocks and swap pages are freed; a token already planned for it is dropped when read. It comes back
        from ``pop_finished``.
        """
        if request in self.waiting:  # preempted while its token was in flight
            self.waiting.remove(request)
            if request.cpu_pages:
                self.block_manager.release_swap_slots(request)
        request.num_pending_tokens = 0
        self._fail(request, message)

    def _fail(self, request: Request, message: str) -> None:
        if request in self.running:
            self.running.remove(request)
            self._released.append(request.index)
        self.requests.pop(request.index, None)
        self.block_manager.free(request)
        self._set_failed(request, message)

    def _set_failed(self, request: Request, message: str) -> None:
        request.status = RequestStatus.FAILED
        request.finish_reason = "error"
        request.error = message
        request.finish_time = time.perf_counter()
        self._finished_unplanned.append(request)


class PrefillFirstScheduler(FIFOScheduler):
    """Finishes chunked prefills (running, then new) before resuming decodes; safety margin 0 by default."""

    def _schedule_phases(self, plan: PlanBuilder, out: SchedulerOutput) -> None:
        self._schedule_running(plan, out, decodes=False)
        self._schedule_waiting(plan, out)
        self._schedule_running(plan, out, decodes=True)


#: The scheduler class of each ``engine.scheduler_type`` (``cbrun.engine.config.SCHEDULER_TYPES``).
SCHEDULERS: dict[str, type[FIFOScheduler]] = {"fifo": FIFOScheduler, "prefill_first": PrefillFirstScheduler}
