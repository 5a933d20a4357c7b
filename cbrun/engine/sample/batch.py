"""One step's sampling settings as per-row tensors on the logits' device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbrun.engine.core.plan import RowSampling
from cbrun.engine.sample import random_stream
from cbrun.engine.sample.filters import FilterHints
from cbrun.engine.sample.token_counts import TokenCounts
from cbrun.engine.worker.device import to_device


@dataclass
class SamplingRow:
    """One logits row to sample: its request's sampling values and the tokens counted as output after its own.

    ``extra_tokens`` are a verify step's proposals before this position (or a draft's earlier proposals). The
    row's token is output position ``request.position + len(extra_tokens)`` (``request.num_pending`` counts the
    tokens sampled on the device but not read yet: async batching).
    """

    request: RowSampling
    extra_tokens: list[int]

    @property
    def position(self) -> int:
        return self.request.position + len(self.extra_tokens)


@dataclass
class SamplingBatch:
    """The settings of R rows, as (R,) tensors on the device (P: the rows with a penalty).

    Attributes:
        greedy: bool; sampled rows use temperature, filters and a draw, greedy rows the argmax.
        temperature: float32 (1 on greedy rows); top_k: int64 (0 off); top_p, min_p: float32.
        seeds, positions: int64 stream keys and output positions (``random_stream.uniform``).
        penalty_rows: (P,) int64 or None; count_rows: (P,) int64 rows of ``TokenCounts.counts``; seen: (P, V)
        bool; extra_counts: (P, V) int32 or None (``TokenCounts.gather``); repetition, presence, frequency: (P,)
        float32.
        token_counts: the ``TokenCounts`` the rows were gathered from.
        stop_rows, stop_tokens: int64 (row, token) pairs masked by ``min_new_tokens``, or None.
        num_logprobs: host list, per row the top log-probabilities asked for (None: off).
        processed_logprobs: host list, per row whether ``logprobs_mode`` is "processed_logprobs".
        greedy_rows: host list of ``greedy``; any_sampled, any_filtered: host flags (skip work no row needs,
            without waiting for the device).
        filter_hints: what the host knows of the sampled rows' filters (``filters.FilterHints``).
    """

    greedy: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    penalty_rows: torch.Tensor | None
    count_rows: torch.Tensor | None
    seen: torch.Tensor | None
    extra_counts: torch.Tensor | None
    token_counts: TokenCounts
    repetition: torch.Tensor | None
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    stop_rows: torch.Tensor | None
    stop_tokens: torch.Tensor | None
    num_logprobs: list[int | None]
    processed_logprobs: list[bool]
    greedy_rows: list[bool]
    any_sampled: bool
    any_filtered: bool
    filter_hints: FilterHints

    def __len__(self) -> int:
        return len(self.num_logprobs)


def build_batch(
    rows: list[SamplingRow], token_counts: TokenCounts, eos_token_ids: frozenset[int], device: torch.device | str
) -> SamplingBatch:
    """The per-row tensors of ``rows`` (one non-blocking host-to-device copy per tensor, ``to_device``; penalised
    rows' counts gathered).

    Args:
        rows: the step's rows in logits order.
        token_counts: the penalised requests' counts (rows are created and updated here).
        eos_token_ids: the model's EOS ids (masked with the stop tokens while ``min_new_tokens`` is unmet).
        device: the logits' device.
    """
    params = [row.request.params for row in rows]
    greedy = [p.greedy for p in params]
    penalised = [i for i, p in enumerate(params) if p.penalised]
    count_rows = seen = extra_counts = None
    if penalised:
        count_rows, seen, extra_counts = token_counts.gather(
            [rows[i].request for i in penalised], [rows[i].extra_tokens for i in penalised]
        )

    def floats(values):
        return to_device(values, torch.float32, device)

    def ints(values):
        return to_device(values, torch.int64, device)

    stop_pairs = [
        (i, t)
        for i, (row, p) in enumerate(zip(rows, params))
        if row.position < p.min_new_tokens
        for t in sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)))
    ]
    any_sampled = not all(greedy)
    sampled = [p for g, p in zip(greedy, params) if not g]
    return SamplingBatch(
        greedy=to_device(greedy, torch.bool, device),
        temperature=floats([1.0 if g else p.temperature for g, p in zip(greedy, params)]),
        top_k=ints([p.top_k for p in params]),
        top_p=floats([p.top_p for p in params]),
        min_p=floats([p.min_p for p in params]),
        seeds=ints([random_stream.stream_key(row.request.seed) for row in rows]),
        positions=ints([row.position for row in rows]),
        penalty_rows=ints(penalised) if penalised else None,
        count_rows=count_rows,
        seen=seen,
        extra_counts=extra_counts,
        token_counts=token_counts,
        repetition=floats([params[i].repetition_penalty for i in penalised]) if penalised else None,
        presence=floats([params[i].presence_penalty for i in penalised]) if penalised else None,
        frequency=floats([params[i].frequency_penalty for i in penalised]) if penalised else None,
        stop_rows=ints([i for i, _ in stop_pairs]) if stop_pairs else None,
        stop_tokens=ints([t for _, t in stop_pairs]) if stop_pairs else None,
        num_logprobs=[p.logprobs for p in params],
        processed_logprobs=[p.logprobs_mode == "processed_logprobs" for p in params],
        greedy_rows=greedy,
        any_sampled=any_sampled,
        any_filtered=any(p.filtered for p in params),
        filter_hints=FilterHints.of(
            [p.top_k for p in sampled], [p.top_p for p in sampled], [p.min_p for p in sampled], token_counts.vocab_size
        ),
    )
