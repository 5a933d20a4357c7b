"""A request and its life cycle: PENDING -> PREFILLING -> DECODING -> FINISHED (or FAILED)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cbrun.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbrun.engine.structured_output.request_state import StructuredOutputRequest

#: Host-side id of a token sampled on the device but not yet read back (async batching). It never reaches the
#: model: the model runner fills its input slot from the previous step's device tensor.
PENDING_TOKEN = -1

#: Source of ``Request.index``: unique within the process, never reused (unlike ``id(request)``).
_request_indices = itertools.count()


class RequestStatus(enum.Enum):
    """Where a request is in its life cycle. Only the scheduler changes it."""

    PENDING = "pending"  # waiting for admission (new, or requeued after a soft reset)
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # queued; its constraint is still compiling (vLLM's WAITING_FOR_FSM)
    PREFILLING = "prefilling"  # admitted; some tokens still to compute before the next sample
    DECODING = "decoding"  # one new token per step
    FINISHED = "finished"
    FAILED = "failed"  # cannot run (bad input, or larger than the whole cache)


@dataclass(eq=False)
class Request:
    """One sequence to generate.

    A request's tokens are ``prompt_token_ids + output_token_ids``. ``num_computed_tokens`` of them have their KV
    in the cache; every step lets it catch up with ``num_tokens`` (vLLM's scheduling rule), so a prefill chunk, a
    decode and a recompute after a soft reset are the same operation: schedule ``num_tokens - num_computed_tokens``
    tokens, or fewer (chunked prefill). A token is sampled when a step reaches ``num_tokens``.

    Attributes:
        request_id: the caller's id.
        index: the engine's key for the request in per-request maps (plans, step handles, the prefix cache's
            hashes): unique in the process and never reused, unlike the caller's id or ``id(request)``.
        prompt_token_ids: prompt ids as run.
        sampling_params: how to sample and when to stop.
        seed: the key of the request's own counter-based random stream (``cbrun.engine.sample.sampler.uniform``), so
            its samples never depend on its batch.
        output_token_ids: generated ids so far, as known on the host.
        num_pending_tokens: tokens sampled on the device whose ids the host has not read yet (async batching:
            0 or 1). They count in ``num_tokens`` so the scheduler can plan the next step around them.
        num_computed_tokens: tokens whose KV is in the cache.
        num_cached_tokens: prompt tokens served from the prefix cache at admission.
        block_table: block ids of the request's pages in position order. Only the block manager changes it.
        sliding_block_table: the ring of sliding-window blocks; position p lives in block
            ``sliding_block_table[(p // page_size) % ring_blocks]`` (block manager's too).
        cpu_pages: pages of the CPU swap buffer holding its KV while it is offloaded, one per device page it had
            (block manager's too).
        status: see ``RequestStatus``; only the scheduler changes it.
        needs_host_sampling: ``sampling_params.needs_processing``, read once by the scheduler when it accepts the
            request (it is needed per request per step; sampling params are not changed after a request is made).
        structured: its constraint's grammar state (``cbrun.engine.structured_output.request_state``), None for free
            text; the engine makes it, the scheduler advances its matcher on committed tokens.
        speculation: the speculator's state of the request (``cbrun.engine.spec_decode.speculative``), None until it first decodes
            with speculation on; only the ``Speculator`` reads or writes it (kept here, not in a map, because it is
            read per request per step and goes with the request).
    """

    request_id: object
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    index: int = field(default_factory=lambda: next(_request_indices))
    output_token_ids: list[int] = field(default_factory=list)
    num_pending_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    sliding_block_table: list[int] = field(default_factory=list)
    cpu_pages: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: str | None = None
    error: str | None = None
    scheduled_time: float | None = None  # when the scheduler first admitted it (``time.perf_counter()``)
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    output_text: str | None = None  # set when a stop string cut the output
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per generated token, when asked for
    prompt_logprobs: list[float] = field(default_factory=list)  # prompt positions from prompt_logprobs_from on
    prompt_greedy: list[bool] = field(default_factory=list)  # whether each such prompt token was the argmax
    needs_host_sampling: bool = False
    speculation: object = None
    structured: StructuredOutputRequest | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, pending ones included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus generated tokens whose ids the host knows."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens not yet in the cache; 1 for a request in steady decode."""
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids of positions ``start:end`` over prompt and output; ``PENDING_TOKEN`` for pending ones."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:  # a prefill chunk
            return self.prompt_token_ids[start:end]
        known = num_prompt + len(self.output_token_ids)
        if start >= num_prompt and end <= known:  # a decode
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        pending = [PENDING_TOKEN] * (end - max(start, known)) if end > known else []
        end = min(end, known)
        if start >= end:
            return pending
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt] + pending
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt] + pending

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.FAILED)
