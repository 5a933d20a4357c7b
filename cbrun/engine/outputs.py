"""What the engine hands back for a finished request."""

from __future__ import annotations

import time
from dataclasses import dataclass

from cbrun.engine.core.request import Request


@dataclass
class RequestOutput:
    """The result of one finished request.

    Attributes:
        request_id: the id given to ``LLMEngine.add_request``.
        prompt_token_ids: the prompt as the engine ran it.
        output_token_ids: generated ids, including a final stop token when one ended the request.
        finish_reason: "stop" (EOS or a stop token), "length" (max_new_tokens or the model's maximum length)
            or "error" (the request could not run; see ``error``).
        error: why the request failed, None on success.
        ttft_s: seconds from arrival to the first generated token (None when none was generated).
        arrival_time: ``time.perf_counter()`` when the request was added.
        finish_time: ``time.perf_counter()`` when it finished.
        stop_reason: the stop token id or stop string that ended it (None otherwise).
        text: the output text cut before a stop string, when one ended it (None otherwise: decode the ids).
        logprobs: per generated token, ``{token id: log-probability}`` (top ``logprobs`` and the chosen one).
        prompt_logprobs: log-probability of each prompt token from ``prompt_logprobs_from`` on.
        prompt_greedy: whether each of those prompt tokens was the model's argmax.
    """

    request_id: object
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    error: str | None = None
    ttft_s: float | None = None
    arrival_time: float = 0.0
    finish_time: float = 0.0
    stop_reason: int | str | None = None
    text: str | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_greedy: list[bool] | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def queue_s(self) -> float | None:
        """Seconds from arrival to its first admission into the batch (None if it was never admitted)."""
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def decode_s(self) -> float | None:
        """Seconds from its first generated token to its finish (None when no token was generated)."""
        return None if self.ttft_s is None else self.finish_time - self.first_token_time


def request_output(request: Request, tokenizer) -> RequestOutput:
    """The ``RequestOutput`` of a finished (or failed) request.

    Args:
        request: the request, finished.
        tokenizer: the engine's tokenizer, or None (the text is then left to the caller: ``text`` None).
    """
    params = request.sampling_params
    # No TTFT for an echo-only request (max_new_tokens 0): its prompt ran for log-probabilities, no token is output.
    has_tokens = request.first_token_time is not None and params.max_new_tokens > 0
    return RequestOutput(
        request.request_id,
        request.prompt_token_ids,
        request.output_token_ids,
        request.finish_reason,
        request.error,
        request.first_token_time - request.arrival_time if has_tokens else None,
        request.arrival_time,
        request.finish_time or time.perf_counter(),
        stop_reason=request.stop_reason,
        text=_output_text(request, tokenizer),
        logprobs=request.logprobs if params.logprobs is not None else None,
        prompt_logprobs=request.prompt_logprobs if params.prompt_logprobs_from else None,
        prompt_greedy=request.prompt_greedy if params.prompt_logprobs_from else None,
        scheduled_time=request.scheduled_time,
        first_token_time=request.first_token_time if has_tokens else None,
    )


def _output_text(request: Request, tokenizer) -> str | None:
    """The output text when it is not simply the decoded ids: cut before a stop string, or without the text of the
    stop token (EOS or ``stop_token_ids``) that ended the request, as vLLM's detokenizer does, unless
    ``include_stop_str_in_output``. None: decode ``output_token_ids``."""
    if request.output_text is not None or not isinstance(request.stop_reason, int):
        return request.output_text
    if request.sampling_params.include_stop_str_in_output or tokenizer is None:
        return None
    return tokenizer.decode(request.output_token_ids[:-1], skip_special_tokens=True)
