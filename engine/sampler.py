"""Token sampling: greedy, temperature, top-k, top-p, each request with its own generator."""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Pick the next token of each request.

    Greedy rows take the argmax in one batched op. Sampled rows draw with the request's own ``torch.Generator``,
    so a row's sample depends only on its logits and its seed, never on the rest of the batch.

    Args:
        logits: (N, vocab_size) next-token logits, row i for ``requests[i]``.
        requests: the N requests that sample this step.

    Returns:
        N token ids.
    """
    token_ids = logits.argmax(dim=-1).tolist()
    for i, request in enumerate(requests):
        params = request.sampling_params
        if not params.greedy:
            token_ids[i] = sample_one(logits[i], params, request.generator)
    return token_ids


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample one token id.

    Args:
        logits: (vocab_size,) logits of any float dtype; processed in float32 on the generator's device (CPU).
        params: temperature > 0, optional top_k / top_p.
        generator: the request's generator (advanced by exactly one draw).
    """
    scores = logits.float().cpu() / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = _top_p_filter(scores, params.top_p)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p`` (Holtzman et al. 2019)."""
    sorted_scores, order = torch.sort(scores, descending=True)
    cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
    drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= top_p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))
