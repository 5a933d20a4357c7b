"""When a request stops: the check the scheduler runs after each token it appends (vLLM v1 ``check_stop``)."""

from __future__ import annotations

from dataclasses import dataclass

from cbrun.engine.core.request import Request
from cbrun.engine.core.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class StopConditions:
    """What ends a request besides its own sampling params.

    Attributes:
        eos_token_ids: the model's EOS ids (ignored for requests with ``ignore_eos``).
        max_model_len: the model's maximum length in tokens; None for no limit (scheduler unit tests).
        stop_matcher: finds stop strings in decoded output; None when there is no tokenizer (the engine then
            refuses requests with stop strings at ``add_request``).
    """

    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    stop_matcher: StopStringMatcher | None = None


@dataclass(frozen=True)
class Stop:
    """Why a request stops, and how its output is cut.

    Attributes:
        finish_reason: "stop" (a stop token, EOS or stop string) or "length" (max_new_tokens or the model's length).
        stop_reason: the stop token id or stop string that ended it, else None.
        output_text: the text before the stop string (through it, with ``include_stop_str_in_output``) when one
            ended it, else None.
        num_output_tokens: how many generated ids to keep (fewer than generated when a stop string cut them).
    """

    finish_reason: str
    num_output_tokens: int
    stop_reason: int | str | None = None
    output_text: str | None = None


def check_stop(request: Request, conditions: StopConditions) -> Stop | None:
    """Whether the request stops after its last appended token; reads the request, changes nothing.

    Checked in this order: a stop token or EOS, the end of a structured output's grammar, a stop string in the output's tail, then max_new_tokens and the
    model's maximum length. A request with ``max_new_tokens = 0`` ran its prompt for prompt log-probabilities
    only (echo): the token its last position sampled is not an output.
    """
    params, output = request.sampling_params, request.output_token_ids
    if params.max_new_tokens == 0:
        return Stop("length", 0)
    token = output[-1]
    if token in params.stop_token_ids or (not params.ignore_eos and token in conditions.eos_token_ids):
        return Stop("stop", len(output), stop_reason=token)
    if request.structured is not None and request.structured.is_terminated:  # the structure and its end token
        return Stop("stop", len(output), stop_reason=token)
    matcher = conditions.stop_matcher
    if params.stop:
        assert matcher is not None  # the engine refuses stop strings without a tokenizer at ``add_request``
        if matcher.find(output, params.stop):
            text, kept_ids, stop = matcher.cut(output, params.stop, params.include_stop_str_in_output)
            return Stop("stop", len(kept_ids), stop_reason=stop, output_text=text)
    if len(output) >= params.max_new_tokens or (  # (``Request.num_known_tokens`` inline: this runs per token)
        conditions.max_model_len is not None and len(request.prompt_token_ids) + len(output) >= conditions.max_model_len
    ):
        return Stop("length", len(output))
    return None
