"""The plan of one step: what the scheduler hands the model runner, as plain values.

The plan is built by the scheduler and read by the model runner and the engine; it holds no live ``Request``, so
the runner never reads a request through it, and a plan launched earlier (async batching) stays what it was while
the scheduler moves its requests on.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``num_tokens`` tokens from position ``start`` on.

    Every field is fixed when the step is planned and nobody changes it afterwards: with async batching the request
    moves on (``Scheduler.advance``) before this step's results are read. (Not ``frozen``: a frozen dataclass's
    ``__init__`` costs about 6x more, and one is built per request per step.)

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
        block_table: the request's full-attention blocks in position order, after this step's allocation.
        sliding_block_table: its sliding-window ring blocks.
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
    block_table: list[int]
    sliding_block_table: list[int]
    spec_token_ids: tuple[int, ...] = ()

    @property
    def num_sample_rows(self) -> int:
        """Logit rows the step samples from for this request: 1 + proposals when it samples, else 0."""
        return 1 + len(self.spec_token_ids) if self.samples else 0

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
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_batch_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)
