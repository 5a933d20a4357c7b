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
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    released_request_indices: list[int] = field(default_factory=list)
    plain_greedy: bool = False

    @property
    def num_batch_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)
