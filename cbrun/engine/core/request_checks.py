"""Whether the engine can run a request at all: the checks ``LLMEngine.add_request`` makes before queueing it."""

from __future__ import annotations

from cbrun.engine.core.request import Request


def request_error(request: Request, vocab_size: int, max_model_len: int, has_tokenizer: bool) -> str | None:
    """Why ``request`` cannot run on this model, or None when it can. The engine fails such a request alone (it
    comes back from the next step with this error); nothing raises.

    Args:
        request: the new request.
        vocab_size: the model's vocabulary size (prompt ids must lie in [0, vocab_size)).
        max_model_len: the model's maximum length in tokens (the prompt must leave room for one more).
        has_tokenizer: whether the engine has a tokenizer (stop strings need one).
    """
    try:
        request.sampling_params.validate()
    except ValueError as e:
        return f"invalid sampling setting: {e}"
    if not request.prompt_token_ids:
        return "empty prompt: nothing to condition on"
    if request.num_prompt_tokens >= max_model_len:
        return (
            f"prompt has {request.num_prompt_tokens} tokens; the model's maximum length is "
            f"{max_model_len}, so no token can be generated"
        )
    bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        return f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
    if request.sampling_params.stop and not has_tokenizer:
        return "stop strings need a tokenizer, and the model directory has none"
    return None
