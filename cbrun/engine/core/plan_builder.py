"""One step's plan while the scheduler fills it: the token and request budgets left, and each request's plan entry
(``ScheduledRequest``) built from the request after its blocks for the step are allocated."""

from __future__ import annotations

from cbrun.engine.config import EngineConfig
from cbrun.engine.core.plan import RowSampling, ScheduledRequest
from cbrun.engine.core.request import Request


class PlanBuilder:
    """Tracks one step's token and request budgets while the scheduler fills it."""

    def __init__(self, config: EngineConfig, prompt_row_budget: int | None = None) -> None:
        limits = config.limits
        self.token_budget = limits.max_batch_tokens
        #: Prompt log-probability rows the step may still score (None: no bound but the token budget).
        self.prompt_row_budget = prompt_row_budget
        self.request_budget = limits.max_requests_per_batch
        self.scheduled: list[ScheduledRequest] = []
        self._indices: set[int] = set()  # ``Request.index`` of the planned requests
        self.plain_greedy = True  # ``SchedulerOutput.plain_greedy``
        self.new_sampling: dict[int, RowSampling] = {}  # ``SchedulerOutput.new_sampling``

    def fit(self, num_tokens: int) -> int:
        """How many of ``num_tokens`` fit the remaining budgets (0 when none or no request slot)."""
        if self.request_budget == 0:
            return 0
        return min(num_tokens, self.token_budget)

    def fit_scored(self, request: Request, start: int, num_tokens: int) -> int:
        """``num_tokens`` from position ``start`` on, cut so that its prompt log-probability rows
        fit ``prompt_row_budget`` (the step's logits then stay inside what the memory budget charged,
        ``cbrun.engine.core.cache_sizing.max_prompt_logprob_rows``); the tokens before its first scored position
        are never cut. 0 when no row fits and the chunk would start with one."""
        budget = self.prompt_row_budget
        if budget is None or not request.sampling_params.prompt_logprobs_from:
            return num_tokens
        scored = _prompt_logprob_positions(request, start, start + num_tokens)
        if len(scored) <= budget:
            return num_tokens
        return scored.start - start + budget

    def add(
        self,
        request: Request,
        num_tokens: int,
        spec_token_ids: tuple[int, ...] = (),
        block_start: int = 0,
        sliding_start: int = 0,
    ) -> None:
        """Plan ``num_tokens`` of the request, after its blocks for them are allocated.

        Args:
            block_start, sliding_start: lengths of its block tables before this step's allocation (0 for a request
                (re)joining the batch: its whole tables go in the plan).
        """
        entry = _plan_entry(request, num_tokens, spec_token_ids, block_start, sliding_start)
        if spec_token_ids or entry.needs_host_sampling or entry.prompt_logprob_positions:
            self.plain_greedy = False
            if not request.sampling_sent:  # the worker keeps it from now on
                request.sampling_sent = True
                self.new_sampling[request.index] = RowSampling.of(request)
        if self.prompt_row_budget is not None and entry.prompt_logprob_positions:
            self.prompt_row_budget -= len(entry.prompt_logprob_positions)
        self.scheduled.append(entry)
        self._indices.add(request.index)
        self.token_budget -= num_tokens
        self.request_budget -= 1

    def contains(self, request: Request) -> bool:
        return request.index in self._indices


def _plan_entry(
    request: Request, num_tokens: int, spec_token_ids: tuple[int, ...], block_start: int, sliding_start: int
) -> ScheduledRequest:
    """The request's share of the step as values, after its blocks for this step are allocated.

    ``num_tokens`` counts the proposals ``spec_token_ids``, which follow the request's own tokens. Its block tables
    go as deltas from ``block_start`` / ``sliding_start`` (see ``cbrun.engine.core.plan``).
    """
    start = request.num_computed_tokens
    end = start + num_tokens - len(spec_token_ids)  # one past the request's own tokens
    num_prompt = len(request.prompt_token_ids)
    num_known = num_prompt + len(request.output_token_ids)
    if num_prompt <= start and end <= num_known:  # a decode (``Request.token_ids``' case, without the call)
        token_ids = request.output_token_ids[start - num_prompt : end - num_prompt]
    else:
        token_ids = request.token_ids(start, end)
    if spec_token_ids:
        token_ids += spec_token_ids
    blocks, ring = request.block_table, request.sliding_block_table
    # Positional: this runs per request per step, and keyword construction costs about three times more.
    return ScheduledRequest(
        request.index,
        request.request_id,
        start,
        num_tokens,
        token_ids,
        end - num_known if end > num_known else 0,  # num_pending_inputs
        end == num_known + request.num_pending_tokens,  # samples
        request.needs_host_sampling,
        _prompt_logprob_positions(request, start, end) if request.sampling_params.prompt_logprobs_from else _NONE,
        block_start,
        blocks[block_start:] if len(blocks) > block_start else _NO_BLOCKS,
        sliding_start,
        ring[sliding_start:] if len(ring) > sliding_start else _NO_BLOCKS,
        spec_token_ids,
    )


_NONE = range(0)  # no prompt log-probability positions
_NO_BLOCKS = ()  # no new blocks (shared: plan values are never changed)


def _prompt_logprob_positions(request: Request, start: int, end: int) -> range:
    """Positions in ``start:end`` whose logits score the next prompt token and are not recorded yet."""
    first = request.sampling_params.prompt_logprobs_from
    if first is None:
        return _NONE
    lo = max(start, first - 1 + len(request.prompt_logprobs))
    hi = min(end, request.num_prompt_tokens - 1)
    return range(lo, max(lo, hi))
