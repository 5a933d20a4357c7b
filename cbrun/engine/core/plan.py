"""The plan of one step: what the scheduler hands the model runner, as plain values.

The plan is built by the scheduler and read by the model runner and the engine; it holds no live ``Request``, so
the runner never reads a request through it, and a plan launched earlier (async batching) stays what it was while
the scheduler moves its requests on.

Block tables travel as deltas (vLLM v1's ``new_block_ids``): the model runner keeps a copy of every running
request's tables in its persistent batch (``cbrun.engine.worker.input_batch``), and each entry carries only the blocks its
request gained since it was last planned, or its whole tables when it (re)joins the batch. The block manager
still owns the tables; the runner's copy is written from plans only::

    plan N:    req 7  block_table_start 0, new_block_ids [4, 9]   -> runner row of 7: [4, 9]
    plan N+1:  req 7  block_table_start 2, new_block_ids []       -> unchanged (a decode inside block 9)
    plan N+5:  req 7  block_table_start 2, new_block_ids [12]     -> [4, 9, 12]
    plan N+9:  released_request_indices [7]                       -> row freed (finished or preempted)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cbrun.engine.core.request import Request
from cbrun.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``num_tokens`` tokens from position ``start`` on.

    Every field is fixed when the step is planned and nobody changes it afterwards: with async batching the request
    moves on (``Scheduler.advance``) before this step's results are read. (Not ``frozen``: a frozen dataclass's
    ``__init__`` costs about 6x more, and one is built per request per step; the scheduler builds it with
    positional arguments, in field order, for the same reason.)

    Attributes:
        request_index: the request's ``Request.index`` (the key of per-request maps).
        request_id: the caller's id (for messages).
        start: the first position computed (the request's ``num_computed_tokens`` at planning).
        num_tokens: tokens computed this step.
        token_ids: ids of positions ``start .. start + num_tokens``; the last ``num_pending_inputs`` of them are
            ``PENDING_TOKEN`` placeholders for tokens the step in flight sampled on the device.
        num_pending_inputs: inputs whose ids are still on the device (async batching; 0 or 1).
        samples: this step reaches the request's last token, so a token is sampled.
        needs_host_sampling: the sampled row is processed on the host (``SamplingParams.needs_processing``).
        prompt_logprob_positions: positions of this step whose logits score the next prompt token, not yet
            recorded (one logit row each, before the sample row).
        block_table_start: how many of the request's full-attention blocks the model runner already holds (those
            before this step's allocation); 0 when the request (re)joins the batch and ``new_block_ids`` is its
            whole table.
        new_block_ids: its full-attention blocks from ``block_table_start`` on, in position order (usually empty
            for a decode: a new block every ``page_size`` tokens).
        sliding_block_start, new_sliding_block_ids: the same for its sliding-window ring.
        spec_token_ids: proposed tokens (speculative decoding), the last ``len(spec_token_ids)`` of ``token_ids``;
            the step computes logits at each of them and at the last known token, ``num_sample_rows`` in all.
    """

    request_index: int
    request_id: object
    start: int
    num_tokens: int
    token_ids: list[int]
    num_pending_inputs: int
    samples: bool
    needs_host_sampling: bool
    prompt_logprob_positions: range
    block_table_start: int
    new_block_ids: Sequence[int]
    sliding_block_start: int
    new_sliding_block_ids: Sequence[int]
    spec_token_ids: tuple[int, ...] = ()

    @property
    def num_sample_rows(self) -> int:
        """Logit rows the step samples from for this request: 1 + proposals when it samples, else 0."""
        return 1 + len(self.spec_token_ids) if self.samples else 0

    @property
    def num_blocks(self) -> int:
        """Full-attention blocks the request holds after this step's allocation."""
        return self.block_table_start + len(self.new_block_ids)

    @property
    def end(self) -> int:
        """One past the last position computed (the context length after this step)."""
        return self.start + self.num_tokens


@dataclass(slots=True)
class RowSampling:
    """What the worker side needs to sample, score or verify one planned request's rows, as values (the worker
    never reads a ``Request``; vLLM v1 sends the same per request in ``NewRequestData``).

    Sent once, in the first plan that samples, scores or verifies the request (``SchedulerOutput.new_sampling``);
    the worker keeps it until the request finishes (``StepSampler``), and a later plan carries only what changes,
    in its ``ScheduledRequest``. So ``num_output_tokens`` and ``num_pending`` are those of the plan that sent it: a
    later step's are ``at(item)``'s.

    Attributes:
        request_index: its ``Request.index``.
        request_id: the caller's id (for messages).
        params: its sampling params (never changed after the request is made).
        seed: its random stream's key.
        prompt_token_ids: its prompt (never changed while it runs).
        output_token_ids: its output list, read only up to ``num_output_tokens`` (the list only grows while the
            request runs, so that prefix is what it was at planning).
        num_output_tokens: output tokens known on the host at planning.
        num_pending: tokens sampled on the device and not read yet at planning (0 or 1).
        structured: its grammar state (``cbrun.engine.structured_output.request_state``), None for free text; its
            matcher is advanced by the scheduler alone, the bitmask builder only fills masks from it.
    """

    request_index: int
    request_id: object
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_output_tokens: int
    num_pending: int
    structured: object = None

    @classmethod
    def of(cls, request: Request) -> "RowSampling":
        """The request's values as they are now (the scheduler builds them when it plans the request)."""
        return cls(
            request.index,
            request.request_id,
            request.sampling_params,
            request.seed,
            request.prompt_token_ids,
            request.output_token_ids,
            len(request.output_token_ids),
            request.num_pending_tokens,
            request.structured,
        )

    def at(self, item: ScheduledRequest) -> RowSampling:
        """The request's values at the step of ``item``, one of its plan entries that samples: its output position
        is the entry's context end (less its proposals) past the prompt; the output on the host is that less the
        entry's pending inputs (a sampling entry's pending inputs are the request's pending tokens)."""
        position = item.start + item.num_tokens - len(item.spec_token_ids) - len(self.prompt_token_ids)
        pending = item.num_pending_inputs
        return RowSampling(
            self.request_index,
            self.request_id,
            self.params,
            self.seed,
            self.prompt_token_ids,
            self.output_token_ids,
            position - pending,
            pending,
            self.structured,
        )

    @property
    def position(self) -> int:
        """The output position of the row's next sampled token (its random stream's counter, ``min_new_tokens``)."""
        return self.num_output_tokens + self.num_pending

    def output_tokens(self) -> list[int]:
        """The output as known at planning."""
        return self.output_token_ids[: self.num_output_tokens]


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Where each plan entry's logit rows are, computed once per plan (``SchedulerOutput.layout``).

    The step's N logit rows are, per entry in plan order, its ``prompt_logprob_positions`` rows, then its
    ``num_sample_rows`` rows; the S sample rows are those last ones, in the same order (the step's read-back has
    one id per sample row)::

        entry:        a (prefill, 2 prompt rows)   b (decode)   c (verify, 2 proposals)
        logit rows:   0 1 | 2                      3            4 5 6
        sample rows:        0                      1            2 3 4

    Attributes:
        first_rows: (entries,) each entry's first logit row.
        first_sample_rows: (entries,) each entry's first logit row that samples (``first_rows`` plus its prompt
            rows).
        first_samples: (entries,) each entry's first index among the sample rows.
        num_rows, num_sample_rows: N and S.
        sample_index_of: ``Request.index -> first_samples`` of the entries that sample.
    """

    first_rows: list[int]
    first_sample_rows: list[int]
    first_samples: list[int]
    num_rows: int
    num_sample_rows: int
    sample_index_of: dict[int, int]

    @classmethod
    def of(cls, scheduled: list[ScheduledRequest]) -> "RowLayout":
        first_rows, first_sample_rows, first_samples, sample_index_of = [], [], [], {}
        row = sample = 0
        for item in scheduled:
            first_rows.append(row)
            row += len(item.prompt_logprob_positions)
            first_sample_rows.append(row)
            first_samples.append(sample)
            if item.samples:
                sample_index_of[item.request_index] = sample
                n = 1 + len(item.spec_token_ids)
                row += n
                sample += n
        return cls(first_rows, first_sample_rows, first_samples, row, sample, sample_index_of)


@dataclass
class SchedulerOutput:
    """The plan of one step, in the order the model runner lays out the batch.

    Attributes:
        scheduled: the requests computed this step.
        swap_out: ``(device page, CPU slot)`` copies the runner makes first (offloaded requests' pages).
        swap_in: ``(CPU slot, device page)`` copies it makes next (requests resumed from CPU); the slots are freed
            once the step's results are read.
        num_preempted: requests offloaded or soft reset while planning.
        released_request_indices: requests that left the running set since the previous plan (finished, failed,
            aborted, offloaded or soft reset): the model runner frees their rows before laying out this step.
        plain_greedy: every entry takes at most one sampled row, the device's argmax (no speculative proposals,
            prompt log-probabilities or host-side sampling), so the runner and the engine take their short paths.
            False is always safe (a plan built by hand).
        new_sampling: ``Request.index -> RowSampling`` of each entry the worker samples on the host side, verifies
            or scores for the first time (vLLM v1's ``NewRequestData``): the only request state the worker side
            reads, sent once; later plans carry only the entries (``RowSampling.at``).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    released_request_indices: list[int] = field(default_factory=list)
    plain_greedy: bool = False
    new_sampling: dict[int, RowSampling] = field(default_factory=dict)
    _layout: RowLayout | None = field(default=None, repr=False, compare=False)

    @property
    def num_batch_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def layout(self) -> RowLayout:
        """The plan's logit-row layout, computed on first use and kept (``RowLayout``)."""
        if self._layout is None:
            self._layout = RowLayout.of(self.scheduled)
        return self._layout


@dataclass
class StepOutput:
    """What the worker side returns for one step, the only thing the scheduler's ``update_from_output`` reads (vLLM
    v1's ``ModelRunnerOutput``), keyed by ``Request.index``.

    Attributes:
        token_ids: per sampling request, the tokens to commit in order: one, or a verify step's accepted proposals
            then its replacement or bonus token.
        logprobs: per request that asked, one ``{token id: log-probability}`` per token of ``token_ids``.
        prompt_logprobs: per request scored this step, (log-probability of each next prompt token, whether it was
            the argmax) for its ``prompt_logprob_positions``.
        errors: per request whose own row failed, the message it fails with (it commits nothing).
    """

    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[list[float], list[bool]]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)

    def fail(self, request_index: int, message: str) -> None:
        """Record a row's error; its tokens, if any were set, are dropped (the first error wins)."""
        self.errors.setdefault(request_index, message)
        self.token_ids.pop(request_index, None)
