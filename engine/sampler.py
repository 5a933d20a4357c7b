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
    logprob_scores, scores = _process(logits, request, eos_token_ids, request.output_token_ids)
    if params.greedy:
        token = _argmax(scores)
    else:
        token = _draw(scores, params, request.generator)
    return token, _logprobs(logprob_scores, token, params.logprobs)


def verify_proposals(logits: torch.Tensor, request: Request, proposals: list[int], eos_token_ids: frozenset[int],
                     draft_probs: torch.Tensor | None = None) -> tuple[list[int], list[dict[int, float]] | None]:
    """The tokens a verify step commits for a host-sampled request: accepted proposals, then one more token.

    Position ``i`` is processed as ``sample_one`` would process it once the committed tokens before it are output
    (penalties and ``min_new_tokens`` see them). Greedy rows accept a proposal while it is the processed argmax.
    Sampled rows use the speculative sampling rule (Leviathan et al. 2023, Chen et al. 2023): accept proposal x,
    drawn from the proposer's distribution q, with probability min(1, p(x) / q(x)), else draw from the residual
    ``max(p - q, 0)`` normalised; after all are accepted, the bonus token is drawn from p at the last position.
    Without ``draft_probs`` the proposal is a point mass (an n-gram proposal has q(x) = 1): accept with p(x), else
    draw from p without x. Every token is thus distributed exactly as plain sampling's. All draws come from
    the request's own generator, so seeded rows are reproducible and independent of their batch.

    Args:
        logits: (len(proposals) + 1, vocab_size) logits at the verified positions, any float dtype.
        request: its sampling params, prompt, output so far and generator.
        proposals: the proposed tokens.
        eos_token_ids: the model's EOS ids.
        draft_probs: (len(proposals), vocab_size) float32 CPU, row i the distribution proposal i was drawn from (a
            draft model's q); None for point-mass proposals. Ignored for greedy rows.

    Returns:
        The committed tokens (1 to ``len(proposals) + 1``), and their log-probabilities as ``sample_one`` gives
        them (None when ``logprobs`` is off).

    Raises:
        SamplingError: as ``sample_one``.
    """
    params = request.sampling_params
    output = list(request.output_token_ids)
    tokens, logprobs = [], []
    for i in range(len(proposals) + 1):
        logprob_scores, scores = _process(logits[i], request, eos_token_ids, output)
        proposal = proposals[i] if i < len(proposals) else None
        q = draft_probs[i] if draft_probs is not None and proposal is not None else None
        token = (_argmax(scores) if params.greedy
                 else _accept_or_resample(scores, params, proposal, request.generator, q))
        tokens.append(token)
        output.append(token)
        logprobs.append(_logprobs(logprob_scores, token, params.logprobs))
        if token != proposal:
            break
    return tokens, logprobs if params.logprobs is not None else None


def _process(logits: torch.Tensor, request: Request, eos_token_ids: frozenset[int], output_token_ids: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores for log-probabilities, scores to choose from) of one (V,) row: penalties, then the filters unless
    greedy; float32 on the CPU."""
    params = request.sampling_params
    raw = logits.to("cpu", torch.float32, copy=True)
    keep_raw = params.logprobs is not None and params.logprobs_mode == "raw_logprobs"
    scores = _apply_penalties(raw.clone() if keep_raw else raw, request, eos_token_ids, output_token_ids)
    if bool(scores.isnan().any()):
        raise SamplingError("the logits hold NaN (after penalties)")
    if not params.greedy:
        scores = _filter(scores, params)
    return (raw if keep_raw else scores), scores


def _argmax(scores: torch.Tensor) -> int:
    token = int(scores.argmax())
    if scores[token] == float("-inf"):
        raise SamplingError("no token is left to sample: penalties and filters ruled out every one")
    return token


def _accept_or_resample(scores: torch.Tensor, params: SamplingParams, proposal: int | None,
                        generator: torch.Generator | None, q: torch.Tensor | None = None) -> int:
    """One position of ``verify_proposals`` for a sampled row (``proposal`` None: the bonus token; ``q`` None: a
    point-mass proposal)."""
    weights = _target_weights(scores, params)
    probs = weights / weights.sum()
    if proposal is None:
        return int(torch.multinomial(probs, 1, generator=generator))
    q_proposal = 1.0 if q is None else float(q[proposal])
    if float(torch.rand((), generator=generator)) * q_proposal < float(probs[proposal]):
        return proposal
    if q is None:
        residual = probs.clone()
        residual[proposal] = 0.0
    else:
        residual = (probs - q).clamp(min=0.0)
    if not float(residual.sum()) > 0.0:  # p <= q everywhere up to rounding: nothing else can be drawn
        return proposal
    return int(torch.multinomial(residual, 1, generator=generator))


def sample_draft(logits: torch.Tensor, request: Request, eos_token_ids: frozenset[int], output_token_ids: list[int]
                 ) -> tuple[int, torch.Tensor]:
    """Draw a draft model's proposal for a sampled request, and the distribution it was drawn from.

    The draft row is processed as the request's target rows are (penalties over ``output_token_ids``, then
    temperature, top-k, top-p, min-p), so q is close to p where the draft is good; any q keeps the target
    distribution (``verify_proposals``). The draw comes from the request's own generator.

    Args:
        logits: (vocab_size,) draft logits, any float dtype.
        request: its sampling params (not greedy), prompt and generator.
        eos_token_ids: the target's EOS ids.
        output_token_ids: the request's output followed by the proposals drawn before this one.

    Returns:
        The proposed token, and q: (vocab_size,) float32 CPU probabilities summing to 1.

    Raises:
        SamplingError: as ``sample_one``.
    """
    _, scores = _process(logits, request, eos_token_ids, output_token_ids)
    weights = _target_weights(scores, request.sampling_params)
    q = weights / weights.sum()
    return int(torch.multinomial(q, 1, generator=request.generator)), q


def _apply_penalties(scores: torch.Tensor, request: Request, eos_token_ids: frozenset[int],
                     output_token_ids: list[int]) -> torch.Tensor:
    """Penalties of a row that follows ``output_token_ids`` (the request's output, or more while verifying)."""
    params = request.sampling_params
    if len(output_token_ids) < params.min_new_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        if stops:
            scores[list(stops)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.prompt_token_ids) | set(output_token_ids)))
        values = scores[seen]
        scores[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_token_ids:
        counts = torch.bincount(torch.tensor(output_token_ids), minlength=scores.numel())[:scores.numel()]
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
    return int(torch.multinomial(_target_weights(scores, params), 1, generator=generator))


def _target_weights(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The (V,) unnormalised distribution a sampled row draws from: softmax of the filtered scores, then min-p."""
    probs = _probabilities(scores)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


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
