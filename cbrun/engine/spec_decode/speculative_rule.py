"""The speculative accept/resample rule for every verified position of a step at once.

Each verified position is a row: its logits, its proposal (the next proposed token; -1 on a request's last row,
the bonus position) and, for a draft model's proposal, the distribution q it was drawn from. A greedy row accepts
its proposal when it is the processed argmax. A sampled row accepts proposal x with probability min(1, p(x) / q(x))
(Leviathan et al. 2023, Chen et al. 2023), p being the row's filtered target distribution; a point-mass (n-gram)
proposal has q(x) = 1. A rejected row draws its replacement from the residual max(p - q, 0) normalised (point
mass: p without x); a bonus row draws from p. The accept number is ``uniform(seed, position, ACCEPT)`` and the
draw ``uniform(seed, position, RESIDUAL)``, so every committed token is distributed exactly as plain sampling's,
and depends on the request's own tokens and seed only. The caller commits, per request, the accepted proposals up
to the first rejected row, then that row's token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbrun.engine.core.faults import SamplingError
from cbrun.engine.core.plan import RowSampling
from cbrun.engine.sample import sampler
from cbrun.engine.sample.sampler import (
    ACCEPT,
    DRAFT,
    ERROR_MESSAGES,
    OK,
    OUT_OF_VOCAB,
    RESIDUAL,
    SamplerOutput,
    SamplingBatch,
    SamplingRow,
    TokenCounts,
    build_batch,
    check_tokens,
    inverse_cdf,
    process,
    sampled_probs,
    uniform_of,
    with_logprobs,
)


@dataclass
class VerifyOutput:
    """Per row: ``accepted`` (R,) bool, and ``sampled`` the token the row commits (its proposal when accepted,
    else the replacement or the bonus token), with errors and log-probabilities as ``SamplerOutput`` (of the
    committed token)."""

    accepted: torch.Tensor
    sampled: SamplerOutput


def verify(
    logits: torch.Tensor,
    batch: SamplingBatch,
    proposals: torch.Tensor,
    draft_probs: torch.Tensor | None,
    has_draft: torch.Tensor | None,
    token_bitmask: torch.Tensor | None = None,
) -> VerifyOutput:
    """Accept or replace each row's proposal.

    Args:
        logits: (R, V) target logits at the verified positions, any float dtype.
        batch: the rows' settings (each row's position and extra tokens: the proposals before it).
        proposals: (R,) int64, the proposal each row verifies; -1 on bonus rows.
        draft_probs: (R, V) float32 q of the rows with a draft proposal (other rows' values unused), or None.
        has_draft: (R,) bool, which rows' proposals came from ``draft_probs``; None: none did.
        token_bitmask: as ``sampler.process``.

    Returns:
        The rows' decisions on the device.
    """
    scores, raw, errors = process(logits, batch, token_bitmask)
    tokens = scores.argmax(dim=1)
    accepted = (proposals >= 0) & (tokens == proposals)
    if batch.any_sampled:
        rows = sampler.sampled_rows(batch, scores.device)
        q, drafted = (draft_probs[rows], has_draft[rows]) if draft_probs is not None else (None, None)
        tokens[rows], accepted[rows] = _accept_or_resample(
            sampled_probs(scores[rows], batch, rows), proposals[rows], q, drafted, batch.keys[rows]
        )
    check_tokens(tokens, errors, scores.shape[1])
    accepted &= errors == OK
    out = with_logprobs(SamplerOutput(tokens, errors, [], []), scores, raw, batch)
    return VerifyOutput(accepted, out)


def _accept_or_resample(
    p: torch.Tensor, proposal: torch.Tensor, q: torch.Tensor | None, drafted: torch.Tensor | None, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of the module's docstring on the sampled rows: accept x with probability min(1, p(x) / q(x)), else
    draw from the residual; a bonus row draws from p.

    Args:
        p: (S, V) float32 the rows' filtered target distributions.
        proposal: (S,) int64 each row's proposal; -1 on bonus rows.
        q: (S, V) float32 the draft distributions (rows not ``drafted``: unused), or None: every proposal is a
            point mass (q(x) = 1).
        drafted: (S,) bool which rows' proposals came from ``q``; None with ``q``.
        keys: (S,) the rows' random keys (``uniform_of``).

    Returns:
        ((S,) int64 the token each row commits, (S,) bool whether it accepted its proposal).
    """
    bonus = proposal < 0
    x = proposal.clamp(min=0)[:, None]
    p_x = p.gather(1, x)[:, 0]
    residual = p.scatter(1, x, 0.0)
    q_x = torch.ones_like(p_x)
    if q is not None:
        assert drafted is not None  # given with q
        q_x = torch.where(drafted, q.gather(1, x)[:, 0], q_x)
        residual = torch.where(drafted[:, None], (p - q).clamp(min=0.0), residual)
    residual = torch.where(bonus[:, None], p, residual)
    accept = ~bonus & (uniform_of(keys, ACCEPT) * q_x < p_x)
    # p <= q everywhere up to rounding: nothing else can be drawn, so the proposal stands.
    accept |= ~bonus & ~(residual.sum(dim=1) > 0.0)
    residual = torch.where(accept[:, None], p, residual)  # any positive row: its draw is unused
    drawn = inverse_cdf(residual, uniform_of(keys, RESIDUAL))
    return torch.where(accept, proposal, drawn), accept


def sample_draft(
    logits: torch.Tensor, request: RowSampling, eos_token_ids: frozenset[int], output_token_ids: list[int]
) -> tuple[int, torch.Tensor]:
    """Draw a draft model's proposal for a sampled request, and the distribution q it was drawn from.

    The draft row is processed as the request's target rows are (penalties over ``output_token_ids``, then
    temperature, top-k, top-p, min-p), so q is close to p where the draft is good; any q keeps the target
    distribution (``verify``). The draw is ``uniform(seed, position, DRAFT)``.

    Args:
        logits: (V,) draft logits, any float dtype.
        request: the request's sampling values (its params not greedy, its seed).
        eos_token_ids: the target's EOS ids.
        output_token_ids: the request's output followed by the proposals drawn before this one.

    Returns:
        The proposed token, and q: (V,) float32 on the logits' device, summing to 1.

    Raises:
        SamplingError: when the row holds NaN or every token is ruled out.
    """
    row = SamplingRow(request, list(output_token_ids[request.num_output_tokens :]))
    batch = build_batch([row], TokenCounts(logits.shape[-1], logits.device), eos_token_ids, logits.device)
    scores, _, errors = process(logits[None], batch)
    message = ERROR_MESSAGES.get(int(errors[0]))
    if message is not None:
        raise SamplingError(message)
    q = sampled_probs(scores, batch)
    token = int(inverse_cdf(q, uniform_of(batch.keys, DRAFT))[0])
    if not 0 <= token < logits.shape[-1]:
        raise SamplingError(ERROR_MESSAGES[OUT_OF_VOCAB])
    return token, q[0]
