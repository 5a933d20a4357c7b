"""Draws from the filtered distribution (top-k, top-p, min-p) of many rows at once, without sorting them.

A row's target is its softmax restricted to the set T its filters keep. T is an upper set of the probabilities:
token x is kept when p(x) >= the k-th largest p (top-k), when the mass of tokens more likely than x within the
top-k set is below ``top_p`` of that set's mass (top-p, Holtzman et al. 2019), and when p(x) >= ``min_p`` * max p
(min-p). ``draw_filtered`` draws x from p over a candidate set S (first every token) by the inverse CDF with one
counter-based uniform number (``random_stream``), and accepts it when x is in T; else every token no more likely
than x leaves S (none of them is in T) and it draws again. An accepted x is distributed as p given T exactly,
since T stays inside S. This is the pivot idea of FlashInfer's sorting-free top-k/top-p sampling; the code is ours.
A round costs a few passes over the row; most rows finish in the first, but each round asks the device whether a
row was rejected. ``filtered_probs`` builds the filtered distribution itself (one sort), for the callers that need
its values (speculative verification, draft proposals, processed log-probabilities) and, with the host's hints and
no read back at all, for ``draw_sorted``: the sampler's draw on a device, where a round's question would make the
host wait for the forward pass (vLLM's sampler sorts the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbrun.engine.sample import random_stream

#: Rounds before the remaining rows fall back to ``filtered_probs`` (a round rejects only tokens outside T).
MAX_ROUNDS = 32


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from unnormalised non-negative weights.

    Args:
        weights: (R, V) float32, non-negative.
        u: (R,) float64 uniform numbers in (0, 1).

    Returns:
        (R,) int64: the first index whose cumulative weight exceeds ``u * total``; its weight is positive. A row
        whose total is not finite and positive (NaN weights: scores that overflowed float32) gets V, outside the
        vocabulary, whatever ``searchsorted`` makes of NaN on the device; the sampler turns that into the row's
        error (``processing.check_tokens``).
    """
    cumulative = weights.cumsum(dim=1)
    total = cumulative[:, -1]
    target = (u * total.double()).to(cumulative.dtype)
    # NOTE: rounding must not push the target to the total, past every token.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]
    valid = torch.isfinite(total) & (total > 0)
    return torch.where(valid, drawn, weights.shape[1])


@dataclass(frozen=True)
class FilterHints:
    """What the host knows of the rows' filters, so that ``draw_filtered`` reads nothing back from the device to
    learn it (a read waits for the forward pass queued before the sampler: async batching would lose its overlap).

    Attributes:
        max_top_k: the largest ``top_k`` in (0, V) over the rows; 0 when no row has an active top-k.
        any_top_p: some row has ``top_p < 1``; any_min_p: some row has ``min_p > 0``.
    """

    max_top_k: int
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def of(cls, top_k: list[int], top_p: list[float], min_p: list[float], vocab: int) -> FilterHints:
        """The hints of rows with these host settings, for logits of width ``vocab``."""
        return cls(max([k for k in top_k if 0 < k < vocab], default=0), any(p < 1.0 for p in top_p), any(min_p))

    @classmethod
    def read(cls, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, vocab: int) -> FilterHints:
        """The hints read back from the rows' device tensors (for callers without the host's settings)."""
        active = (top_k > 0) & (top_k < vocab)
        max_top_k = int(torch.where(active, top_k, 0).max()) if top_k.numel() else 0
        return cls(max_top_k, bool((top_p < 1.0).any()), bool((min_p > 0).any()))


def kth_largest(probs: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None = None) -> torch.Tensor:
    """(R,) the ``top_k``-th largest probability of each row; 0 where top_k is 0 or at least V (off).

    ``max_top_k``: ``FilterHints.max_top_k`` when the host knows it (nothing is read from the device then); None
    reads it from ``top_k``. Rows without an active top-k join the one ``topk`` call and get 0.
    """
    vocab = probs.shape[1]
    active = (top_k > 0) & (top_k < vocab)
    kth = torch.zeros(probs.shape[0], dtype=probs.dtype, device=probs.device)
    if max_top_k is None:
        max_top_k = int(torch.where(active, top_k, 0).max()) if top_k.numel() else 0
    max_top_k = min(max_top_k, vocab - 1)  # active rows have top_k < V (a hint made for wider logits)
    if max_top_k <= 0:
        return kth
    values = torch.topk(probs, max_top_k, dim=1).values
    picked = values.gather(1, (top_k.clamp(1, max_top_k) - 1)[:, None])[:, 0]
    return torch.where(active, picked, kth)


def draw_filtered(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    hints: FilterHints | None = None,
) -> torch.Tensor:
    """One token per row from p restricted to its top-k / top-p / min-p set, by rejection with pivots.

    Args:
        probs: (R, V) float32 softmax of the processed scores (rows sum to 1, finite).
        top_k: (R,) int64, 0 off; top_p: (R,) float32, 1 off; min_p: (R,) float32, 0 off.
        seeds, positions: (R,) int64, the rows' stream keys and output positions (``random_stream.uniform``).
        hints: the host's view of the filters (the same tokens; fewer device reads); None reads the tensors.
            Each round still reads one flag (whether a row was rejected).

    Returns:
        (R,) int64 tokens. Round r draws with ``uniform(seed, position, PLAIN + r)``.
    """
    if hints is None:
        hints = FilterHints.read(top_k, top_p, min_p, probs.shape[1])
    kth = kth_largest(probs, top_k, hints.max_top_k)
    mass_k = None  # per row the mass of its top-k set; 1 without one (not the row's float sum: batch-independent)
    if hints.max_top_k:
        mass_k = torch.where(kth > 0, torch.where(probs >= kth[:, None], probs, 0.0).sum(dim=1), 1.0)
    # The top-k and min-p bounds in one: p(x) must reach both.
    floor_p = torch.maximum(kth, min_p * probs.amax(dim=1)) if hints.any_min_p else kth
    nucleus = top_p < 1.0
    any_nucleus = hints.any_top_p
    tokens = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    pending = torch.arange(probs.shape[0], device=probs.device)
    pivot = None  # per pending row: tokens no more likely than this have been ruled out
    for round_ in range(MAX_ROUNDS):
        p = probs if round_ == 0 else probs[pending]
        weights = p if pivot is None else torch.where(p > pivot[:, None], p, 0.0)
        u = random_stream.uniform(seeds[pending], positions[pending], random_stream.PLAIN + round_)
        x = inverse_cdf(weights, u)
        # NOTE: a row without a finite distribution drew V (``inverse_cdf``): it stops here, and its token fails it.
        drawn = x < probs.shape[1]
        px = p.gather(1, torch.where(drawn, x, 0)[:, None])[:, 0]
        keep = px >= floor_p[pending]
        if any_nucleus:
            above = torch.where(p > px[:, None], p, 0.0).sum(dim=1)
            budget = top_p[pending] * (mass_k[pending] if mass_k is not None else 1.0)
            keep &= ~nucleus[pending] | (above < budget)
        keep |= ~drawn
        tokens[pending[keep]] = x[keep]
        rejected = ~keep
        if not bool(rejected.any()):
            return tokens
        pivot = px[rejected]
        pending = pending[rejected]
    rest = filtered_probs(probs[pending], top_k[pending], top_p[pending], min_p[pending])
    tokens[pending] = inverse_cdf(
        rest, random_stream.uniform(seeds[pending], positions[pending], random_stream.PLAIN + MAX_ROUNDS)
    )
    return tokens


def filtered_probs(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    hints: FilterHints | None = None,
) -> torch.Tensor:
    """The filtered distribution itself: p restricted to the set ``draw_filtered`` accepts, renormalised.

    Args:
        probs: (R, V) float32 rows summing to 1; top_k, top_p, min_p: (R,) as in ``draw_filtered``.
        hints: the host's view of the filters (``FilterHints``; hints of a superset of the rows are fine). With
            them nothing is read back from the device: every row takes the same fixed-shape ops (one sort of all
            rows when some row has a top-p, as vLLM's sampler does), so the host never waits. Without them the
            filters are read from the tensors, and only the top-p rows are sorted (cheaper on a CPU).

    Returns:
        (R, V) float32 rows summing to 1 (filtered tokens 0).
    """
    kth = kth_largest(probs, top_k, hints.max_top_k if hints is not None else None)
    kept = torch.where(probs >= kth[:, None], probs, 0.0)
    nucleus = top_p < 1.0
    if hints is not None:
        if hints.any_top_p:
            sorted_p, order = torch.sort(kept, dim=1, descending=True)
            before = sorted_p.cumsum(dim=1) - sorted_p  # mass of the tokens ranked above each
            drop = (before >= top_p[:, None] * sorted_p.sum(dim=1, keepdim=True)) & nucleus[:, None]
            drop[:, 0] = False  # the most likely token always stays
            kept = torch.where(torch.zeros_like(drop).scatter(1, order, drop), 0.0, kept)
    elif bool(nucleus.any()):
        sorted_p, order = torch.sort(kept[nucleus], dim=1, descending=True)
        before = sorted_p.cumsum(dim=1) - sorted_p
        drop = before >= top_p[nucleus, None] * sorted_p.sum(dim=1, keepdim=True)
        drop[:, 0] = False
        kept[nucleus] = torch.where(torch.zeros_like(drop).scatter(1, order, drop), 0.0, kept[nucleus])
    kept = torch.where(kept >= (min_p * probs.amax(dim=1))[:, None], kept, 0.0)
    return kept / kept.sum(dim=1, keepdim=True)


def draw_sorted(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    hints: FilterHints,
) -> torch.Tensor:
    """One token per row from p restricted to its top-k / top-p / min-p set, with no read back from the device:
    the filtered distribution (``filtered_probs`` with the host's hints) and one inverse-CDF draw with
    ``uniform(seed, position, PLAIN)``. The same distribution as ``draw_filtered`` (not the same draws); the
    sampler takes it on a device, where each of ``draw_filtered``'s rounds would wait for the forward pass.

    Returns:
        (R,) int64 tokens (V for a row without a finite distribution, as ``inverse_cdf``).
    """
    kept = filtered_probs(probs, top_k, top_p, min_p, hints)
    return inverse_cdf(kept, random_stream.uniform(seeds, positions, random_stream.PLAIN))
