"""Token sampling on the host: logits processing, seeded sampling and log-probabilities, one request per row.

Plain greedy rows never come here: the model runner takes their argmax on the device (see ``ModelRunner.launch``).
"""

from __future__ import annotations

import torch

from engine.faults import SamplingError
from engine.request import Request
from engine.sampling_params import SamplingParams


def sample_one(logits: torch.Tensor, request: Request, eos_token_ids: frozenset[int]
               ) -> tuple[int, dict[int, float] | None]:
    """Process one row's logits and choose its token.

    Args:
        logits: (vocab_size,) logits of any float dtype; processed in float32 on the CPU (the generator's device).
        request: supplies the sampling params, its prompt and output tokens, and its generator.
        eos_token_ids: the model's EOS ids.

    Returns:
        The token id, and the log-probabilities asked for by ``logprobs`` (None when off): by default
        (``logprobs_mode = "raw_logprobs"``, vLLM's default) the log-softmax of the model's logits before any
        processing; with "processed_logprobs", of the distribution the token was drawn from (after penalties,
        temperature, top-k and top-p; filtered tokens are -inf; greedy rows: after penalties).

    Raises:
        SamplingError: when the logits hold NaN, or penalties and filters rule out every token. A token scored
            +inf (e.g. by a huge negative penalty) takes all the probability, shared with any other +inf token.
    """
    params = request.sampling_params
    raw = logits.to("cpu", torch.float32, copy=True)
    keep_raw = params.logprobs is not None and params.logprobs_mode == "raw_logprobs"
    scores = _apply_penalties(raw.clone() if keep_raw else raw, request, eos_token_ids)
    if bool(scores.isnan().any()):
        raise SamplingError("the logits hold NaN (after penalties)")
    if params.greedy:
        token = int(scores.argmax())
        if scores[token] == float("-inf"):
            raise SamplingError("no token is left to sample: penalties and filters ruled out every one")
    else:
        scores = _filter(scores, params)
        token = _draw(scores, params, request.generator)
    return token, _logprobs(raw if keep_raw else scores, token, params.logprobs)


def _apply_penalties(scores: torch.Tensor, request: Request, eos_token_ids: frozenset[int]) -> torch.Tensor:
    params = request.sampling_params
    if len(request.output_token_ids) < params.min_new_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        if stops:
            scores[list(stops)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.prompt_token_ids) | set(request.output_token_ids)))
        values = scores[seen]
        scores[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and request.output_token_ids:
        counts = torch.bincount(torch.tensor(request.output_token_ids), minlength=scores.numel())[:scores.numel()]
        # Only the generated tokens: a penalty that overflows float32 times a zero count would be NaN elsewhere.
        seen = counts.nonzero()[:, 0]
        scores[seen] -= params.frequency_penalty * counts[seen] + params.presence_penalty
    return scores


def _filter(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k and top-p (filtered tokens become -inf)."""
    scores = scores / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = _top_p_filter(scores, params.top_p)
    return scores


def _draw(scores: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Min-p over the filtered distribution, then one draw from the request's generator."""
    probs = _probabilities(scores)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``."""
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = _probabilities(sorted_scores)
    # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def _logprobs(scores: torch.Tensor, token: int, num_top: int | None) -> dict[int, float] | None:
    if num_top is None:
        return None
    logprobs = _log_probabilities(scores)
    result = {token: float(logprobs[token])}
    if num_top:
        top = torch.topk(logprobs, min(num_top, logprobs.numel()))
        result.update(zip(top.indices.tolist(), top.values.tolist()))
    return result


def _probabilities(scores: torch.Tensor) -> torch.Tensor:
    """softmax over (V,) NaN-free scores, safe against inf: +inf tokens share all the mass.

    Raises:
        SamplingError: when every score is -inf.
    """
    top = float(scores.max())
    if top == float("inf"):
        winners = (scores == top).float()
        return winners / winners.sum()
    if top == float("-inf"):
        raise SamplingError("no token is left to sample: penalties and filters ruled out every one")
    return torch.softmax(scores, dim=-1)


def _log_probabilities(scores: torch.Tensor) -> torch.Tensor:
    """log_softmax over (V,) NaN-free scores; with +inf scores, the log of ``_probabilities`` instead of NaN."""
    if float(scores.max()) == float("inf"):
        return torch.log(_probabilities(scores))
    return torch.log_softmax(scores, dim=-1)
