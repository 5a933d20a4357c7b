"""After the forward pass: the scheduler's half that turns a launched step's pending tokens into known ones.

``StepResolver`` is a base of ``cbrun.engine.core.scheduler.FIFOScheduler`` and only runs as part of it (it reads and writes the
scheduler's queues and counters): ``advance`` once a step is launched, ``resolve`` once its tokens are read (each token
through the stop check, a verify step's rejected proposals rolled back), and finishing a request that stops."""

from __future__ import annotations

import time

from cbrun.engine.core.faults import is_request_fault, request_error_message
from cbrun.engine.core.plan import ScheduledRequest, SchedulerOutput
from cbrun.engine.core.request import Request, RequestStatus
from cbrun.engine.core.stop_check import Stop, check_stop


class StepResolver:
    """The scheduler's methods after the forward pass (``FIFOScheduler`` holds the state they use)."""

    def update(self, out: SchedulerOutput, sampled: dict[int, int | list[int]]) -> list[Request]:
        """``advance`` then ``resolve``: the synchronous step, results read before the next plan."""
        self.advance(out)
        return self.resolve(out, sampled)

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

    def resolve(self, out: SchedulerOutput, sampled: dict[int, int | list[int]]) -> list[Request]:
        """Turn a launched step's pending tokens into known ones and finish the requests that stop.

        A verify step (an entry with ``spec_token_ids``) commits its accepted tokens and bonus token one at a
        time, each through the stop check, so a stop inside the run cuts exactly where plain decoding would; the
        slots of the rejected proposals are rolled back (``num_computed_tokens``, and blocks past it freed).

        Args:
            out: the step's plan (already ``advance``d).
            sampled: ``Request.index -> token id`` for each planned request that sampled; for a verify step, the
                list of tokens it commits (the accepted proposals, then the bonus token; ``accept_greedy``).

        Returns:
            The requests that finished (their blocks are already free). A request that finished in an earlier
            step but was planned again before that was known is skipped: its extra token is dropped.
        """
        self.discard(out)
        finished = []
        requests = self.requests
        for item in out.scheduled:
            if not item.samples:
                continue
            request = requests.get(item.request_index)
            if request is None:  # finished since this step was planned
                continue
            request.num_pending_tokens -= 1
            tokens = sampled[request.index]
            tokens = (tokens,) if isinstance(tokens, int) else tokens
            if item.spec_token_ids:
                self._roll_back_rejected(request, item, num_accepted=len(tokens) - 1)
            if self._commit(request, tokens):
                finished.append(request)
            elif item.spec_token_ids and request.status is RequestStatus.DECODING:
                self.block_manager.trim(request)
        return finished

    def _commit(self, request: Request, tokens: list[int]) -> bool:
        """Append tokens one at a time, each through the stop check; True when the request finished."""
        counts = request.sampling_params.max_new_tokens > 0
        for token in tokens:
            if request.structured is not None and counts and not request.structured.accept(token):
                self.fail_request(
                    request,
                    f"structured outputs: token {token} is not allowed by the constraint "
                    "(the sampler's mask was not applied)",
                )
                return False
            request.output_token_ids.append(token)
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
        self.speculator.record(request, num_proposed, num_accepted)

    def discard(self, out: SchedulerOutput) -> None:
        """Free the CPU slots a launched plan swapped in from (its copies ran); ``resolve`` calls it, and the
        engine for a plan in flight whose results it drops."""
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
