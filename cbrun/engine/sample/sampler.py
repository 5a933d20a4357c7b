"""The sampler: every sampled row of a step in one pass of tensor ops on the logits' device.

One concept, in the order a row meets it:

- **Settings** (``SamplingSlots``, ``SamplingBatch``): each request's settings are written once into persistent
  per-request arrays and gathered per step into the batch's sampling metadata, its predicates (any sampled row,
  any filter, any log-probabilities, ...) computed once; the penalised requests' token counts (``TokenCounts``).
- **Processing**: per row, in order (vLLM's sampler and transformers' logits processors use the same order), the
  token bitmask (structured output), ``min_new_tokens`` (stop tokens masked), repetition penalty, presence and
  frequency penalties; the inf/NaN rules. Raw log-probabilities are read before the penalties, processed ones after
  the filters.
- **The draw**: greedy rows take the argmax; sampled rows divide by their temperature, take the softmax and draw from
  their top-k / top-p / min-p set (``draw_filtered``, ``draw_sorted``) with their own counter-based random stream
  (``uniform``).
- **Checks**: every chosen id is checked to lie in the vocabulary (``check_tokens``); only the tokens, the per-row
  error codes and the log-probabilities asked for ever leave the device, packed into the step's one read-back
  (``encode_errors``, ``float_bits``).

The random stream. A request's draws never come from a stateful generator: the number used for its token at output
position ``t`` and draw ``d`` is ``uniform(seed, t, d)``, the SplitMix64 finaliser (Steele, Lea and Flood 2014,
"Fast splittable pseudorandom number generators"; the constants are Vigna's ``splitmix64.c``) chained over the three
integers. So a row's tokens do not depend on its batch, the step it runs in, preemption and resume, or the device:
the same integer arithmetic runs on any device (int64 multiplication wraps modulo 2**64 on every torch backend;
right shifts are arithmetic on int64, so a logical shift is a shift and a mask). The draw indices a sampler uses
are named here (``PLAIN``, ``ACCEPT``, ...), so two uses never share a number.

The filters. A row's target is its softmax restricted to the set T its filters keep. T is an upper set of the
probabilities: token x is kept when p(x) >= the k-th largest p (top-k), when the mass of tokens more likely than x
within the top-k set is below ``top_p`` of that set's mass (top-p, Holtzman et al. 2019), and when p(x) >= ``min_p``
* max p (min-p). ``draw_filtered`` draws x from p over a candidate set S (first every token) by the inverse CDF with
one counter-based uniform number, and accepts it when x is in T; else every token no more likely than x leaves S
(none of them is in T) and it draws again. An accepted x is distributed as p given T exactly, since T stays inside
S. This is the pivot idea of FlashInfer's sorting-free top-k/top-p sampling; the code is ours. A round costs a few
passes over the row; most rows finish in the first, but each round asks the device whether a row was rejected.
``filtered_probs`` builds the filtered distribution itself (one sort), for the callers that need its values
(speculative verification, draft proposals, processed log-probabilities) and, with the host's hints and no read back
at all, for ``draw_sorted``: the sampler's draw on a device, where a round's question would make the host wait for
the forward pass (vLLM's sampler sorts the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, TypedDict

import numpy as np
import torch

from cbrun.engine.core.plan import RowSampling
from cbrun.engine.sampling_params import SamplingParams
from cbrun.engine.worker.device import to_device, waits_for_device
from cbrun.kernels import cpu_sampler, cpu_token_mask

# ---- per-row error codes and processing ---------------------------------------------------------------------

#: Per-row error codes (``SamplingBatch`` rows that cannot give a token fail alone).
OK, NAN_LOGITS, NOTHING_LEFT, OUT_OF_VOCAB = 0, 1, 2, 3
ERROR_MESSAGES = {
    NAN_LOGITS: "non-finite logits after penalties: the scores hold NaN",
    NOTHING_LEFT: "no token is left to sample: penalties and filters ruled out every one",
    OUT_OF_VOCAB: "non-finite probabilities after penalties and temperature: the sampled id is outside the vocabulary",
}

_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_tokens(token_bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Expand xgrammar's packed bitmask into a boolean mask.

    Args:
        token_bitmask: (R, ceil(V / 32)) int32; bit j of word i set means token ``32 * i + j`` is allowed
            (xgrammar's ``allocate_token_bitmask`` layout).
        vocab_size: V, the logits' width (bits past it are ignored; tokens past the mask's width are disallowed).

    Returns:
        (R, V) bool, True where allowed.
    """
    device = token_bitmask.device
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = (token_bitmask.to(torch.int32)[:, :, None] >> shifts) & 1
    allowed = bits.reshape(token_bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=device)
    return torch.cat((allowed, pad), dim=1)


def apply_token_bitmask(scores: torch.Tensor, token_bitmask: torch.Tensor) -> torch.Tensor:
    """Set disallowed tokens to -inf in place. scores: (R, V) float; token_bitmask: (R, ceil(V / 32)) int32.

    On the CPU (float32) our C kernel does it (``cbrun.kernels.cpu_token_mask``: fully allowed words are skipped);
    elsewhere xgrammar's kernel (CUDA / Triton on a GPU), installed whenever there is a mask since the masks come
    from xgrammar. Both read the packed words as they are, about 5x faster than unpacking them into a boolean
    tensor (``allowed_tokens``, the fallback) at 256 rows of 32000.
    """
    if token_bitmask.shape[0] != scores.shape[0]:
        raise ValueError(f"token_bitmask has {token_bitmask.shape[0]} rows; the logits have {scores.shape[0]}")
    if cpu_token_mask.supports(scores, token_bitmask):
        cpu_token_mask.apply_token_bitmask_cpu(scores, list(range(scores.shape[0])), token_bitmask)
        return scores
    if token_bitmask.shape[1] * 32 >= scores.shape[1] and token_bitmask.dtype == torch.int32:
        try:
            import xgrammar
        except ImportError:
            pass
        else:
            xgrammar.apply_token_bitmask_inplace(scores, token_bitmask.to(scores.device), vocab_size=scores.shape[1])
            return scores
    return scores.masked_fill_(~allowed_tokens(token_bitmask, scores.shape[1]), float("-inf"))


def apply_stop_mask(scores: torch.Tensor, rows: torch.Tensor | None, tokens: torch.Tensor | None) -> None:
    """``min_new_tokens``: set (row, token) pairs to -inf in place (the stop tokens of rows still too short)."""
    if rows is not None:
        scores[rows, tokens] = float("-inf")


def apply_penalties(
    scores: torch.Tensor,
    rows: torch.Tensor,
    counts: torch.Tensor,
    count_rows: torch.Tensor,
    seen: torch.Tensor,
    extra_counts: torch.Tensor | None,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> None:
    """Repetition (prompt and output tokens, CTRL: Keskar et al. 2019), presence and frequency penalties (output
    tokens, OpenAI's), in place on ``scores[rows]``.

    On a device, dense over the P penalised rows: every entry is computed and the seen ones kept (``torch.where``),
    so nothing has a shape the host must read first (a ``nonzero`` of the seen tokens would wait for the forward
    pass); P x V elementwise work is a few microseconds on a GPU. On the CPU, where that read is free, one
    ``nonzero`` finds the seen tokens and only those entries are touched. Both give the same values.

    Args:
        scores: (R, V) float32.
        rows: (P,) int64, the rows with a penalty.
        counts: (N, V) int32 output token counts (``TokenCounts.counts``); count_rows: (P,) int64 its row of each.
        seen: (P, V) bool, each row's prompt and output tokens.
        extra_counts: (P, V) int32 counts added to ``counts`` (tokens after the request's output), or None.
        repetition, presence, frequency: (P,) float32.
    """
    if not waits_for_device(scores.device):  # on the CPU the read is free: only the seen entries are touched
        at, token = seen.nonzero(as_tuple=True)
        row = rows[at]
        values = scores[row, token]
        count = counts[count_rows[at], token]
        if extra_counts is not None:
            count = count + extra_counts[at, token]
        rep = repetition[at]
        values = torch.where(values > 0, values / rep, values * rep)
        # NOTE: only where a count is positive: a penalty that overflows float32 times a zero count would be NaN.
        values = torch.where(count > 0, values - (frequency[at] * count + presence[at]), values)
        scores[row, token] = values
        return
    values = scores[rows]
    count = counts[count_rows]
    if extra_counts is not None:
        count = count + extra_counts
    rep = repetition[:, None]
    penalised = torch.where(values > 0, values / rep, values * rep)
    penalised = torch.where(count > 0, penalised - (frequency[:, None] * count + presence[:, None]), penalised)
    scores[rows] = torch.where(seen, penalised, values)


def settle_infinities(scores: torch.Tensor) -> torch.Tensor:
    """Per-row error codes, and +inf rows turned into finite ones in place.

    A row holding NaN fails (``NAN_LOGITS``); a row whose every score is -inf fails (``NOTHING_LEFT``); a row
    holding +inf gives all its probability to its +inf tokens, shared equally (scores become 0 there, -inf
    elsewhere).

    Returns:
        (R,) int8 error codes.
    """
    return _settle(scores)[0]


def _settle(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``settle_infinities``' error codes, and each row's maximum when it is still the maximum of the settled scores
    (no row held +inf; known on the CPU only, where the check is free), else None."""
    top = scores.amax(dim=1)  # NaN where the row holds NaN
    if not waits_for_device(scores.device) and bool(top.isfinite().all()):  # the common step, on the CPU
        return torch.zeros(scores.shape[0], dtype=torch.int8, device=scores.device), top
    nan = top.isnan()
    inf_rows = top == float("inf")
    if waits_for_device(scores.device):  # no host read of the device (it would wait for the forward pass)
        settled = torch.where(scores == float("inf"), 0.0, float("-inf"))
        scores.copy_(torch.where(inf_rows[:, None], settled, scores))
        kept_top = None
    elif bool(inf_rows.any()):
        sub = scores[inf_rows]
        scores[inf_rows] = torch.where(sub == float("inf"), 0.0, float("-inf"))
        kept_top = None
    else:
        kept_top = top
    errors = torch.zeros(scores.shape[0], dtype=torch.int8, device=scores.device)
    errors.masked_fill_(top == float("-inf"), NOTHING_LEFT)
    return errors.masked_fill_(nan, NAN_LOGITS), kept_top


def check_tokens(tokens: torch.Tensor, errors: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every chosen id checked to lie in the vocabulary before anything commits it or feeds it to the next step.

    In place, on the device (no host read): a row whose id is outside ``[0, vocab_size)`` gets ``OUT_OF_VOCAB``
    unless it already failed, and every failed row's id becomes 0, so that a token fed to the next step's
    embedding on the device (async batching) is always a valid index; the host drops the failed row's token.

    Args:
        tokens: (R,) int64 chosen ids.
        errors: (R,) int8 codes, updated in place.
        vocab_size: V.

    Returns:
        ``tokens``, with failed rows' ids 0.
    """
    outside = (tokens < 0) | (tokens >= vocab_size)
    errors.masked_fill_(outside & (errors == OK), OUT_OF_VOCAB)
    return tokens.masked_fill_(errors != OK, 0)


def encode_errors(tokens: torch.Tensor, errors: torch.Tensor) -> torch.Tensor:
    """(R,) int64: ``tokens`` with each failed row's id replaced by ``-1 - code``, so that ids and errors come back
    to the host in one copy (``decode_error``)."""
    return torch.where(errors != OK, -1 - errors.to(tokens.dtype), tokens)


def decode_error(token: int) -> str | None:
    """The error message of one read-back id of ``encode_errors`` (None for a real token)."""
    if token >= 0:
        return None
    return ERROR_MESSAGES.get(-1 - token, f"sampling error code {-1 - token}")


# ---- the random stream ---------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)

#: Draw indices. A plain draw's rejection rounds use ``PLAIN + round``; speculative verification uses one number
#: to accept a proposal and one to draw its replacement; a draft model's proposal its own.
PLAIN = 0
ACCEPT = 1 << 20
RESIDUAL = ACCEPT + 1
DRAFT = ACCEPT + 2


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values read as unsigned."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of ``x + golden``, elementwise over int64 (a bijection of 64-bit patterns)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _mix_int(x: int) -> int:
    """``mix64`` of one value in plain Python integers (unsigned 64-bit patterns)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_key(seed: int) -> int:
    """A request seed (any Python int) as the int64 the stream takes (its low 64 bits)."""
    return _signed(seed)


def seed_hash(seed: int) -> int:
    """``mix64(stream_key(seed))`` as the int64 torch stores: the first link of the chain, the same for every
    number a request draws, so it is computed once per request (``SamplingSlots``)."""
    return _signed(_mix_int(seed & _MASK64))


def row_keys(seed_hashes: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(R,) int64 ``mix64(seed_hash + position)``: the chain up to the draw index (``uniform_of``)."""
    return mix64(seed_hashes + positions)


def uniform_of(keys: torch.Tensor, draws: torch.Tensor | int) -> torch.Tensor:
    """``uniform`` from the rows' ``row_keys``: (R,) float64 in (0, 1) (the shape of ``keys + draws``).

    On the CPU the same integer arithmetic runs in numpy (``_uniform_np``): a dozen small ops cost a few
    microseconds each in torch and well under one in numpy, and the values are the same bits.
    """
    if keys.device.type == "cpu" and (isinstance(draws, int) or draws.device.type == "cpu"):
        return torch.from_numpy(_uniform_np(keys.numpy(), draws if isinstance(draws, int) else draws.numpy()))
    h = mix64(keys + draws)
    return (_shr(h, 11).double() + 0.5) * 2.0**-53


def _uniform_np(keys: np.ndarray, draws: np.ndarray | int) -> np.ndarray:
    """``uniform_of`` over int64 numpy keys (unsigned arithmetic, which wraps as torch's int64 does)."""
    h = _mix_np(keys.view(np.uint64) + np.asarray(draws, dtype=np.int64).view(np.uint64))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def uniform(seeds: torch.Tensor, positions: torch.Tensor, draws: torch.Tensor | int) -> torch.Tensor:
    """One uniform number in (0, 1) per row: a pure function of the three integers.

    Args:
        seeds: (R,) int64 stream keys (``stream_key``).
        positions: (R,) int64 output positions of the tokens being drawn.
        draws: (R,) int64 or an int: the draw index (``PLAIN``, ``ACCEPT``, ...).

    Returns:
        (R,) float64 on the seeds' device, ``(top 53 bits + 0.5) / 2**53``, never 0 or 1.
    """
    return uniform_of(row_keys(mix64(seeds), positions), draws)


def reference_uniform(seed: int, position: int, draw: int) -> float:
    """``uniform`` for one row in plain Python integers (the oracle of the tests)."""
    h = _mix_int((_mix_int((_mix_int(seed & _MASK64) + position) & _MASK64) + draw) & _MASK64)
    return ((h >> 11) + 0.5) * 2.0**-53


# ---- filters and draws ----------------------------------------------------------------------------------------

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
        error (``check_tokens``).
    """
    cumulative = weights.cumsum(dim=1)
    total = cumulative[:, -1]
    drawn = _search(cumulative, total, u)
    valid = torch.isfinite(total) & (total > 0)
    return torch.where(valid, drawn, weights.shape[1])


def _search(cumulative: torch.Tensor, total: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(R,) int64 the first index of each row's ``cumulative`` weights exceeding ``u * total`` (``inverse_cdf``)."""
    target = (u * total.double()).to(cumulative.dtype)
    # NOTE: rounding must not push the target to the total, past every token.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]


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
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row from p restricted to its top-k / top-p / min-p set, by rejection with pivots.

    Args:
        probs: (R, V) float32 softmax of the processed scores (rows sum to 1, finite).
        top_k: (R,) int64, 0 off; top_p: (R,) float32, 1 off; min_p: (R,) float32, 0 off.
        seeds, positions: (R,) int64, the rows' stream keys and output positions (``uniform``).
        hints: the host's view of the filters (the same tokens; fewer device reads); None reads the tensors.
            Each round still reads one flag (whether a row was rejected).
        keys: the rows' ``row_keys`` when the caller has them (the same numbers; ``seeds`` is then unused).

    Returns:
        (R,) int64 tokens. Round r draws with ``uniform(seed, position, PLAIN + r)``.
    """
    vocab = probs.shape[1]
    if hints is None:
        hints = FilterHints.read(top_k, top_p, min_p, vocab)
    if keys is None:
        keys = row_keys(mix64(seeds), positions)
    floor_p, budget, nucleus = _filter_bounds(probs, top_k, top_p, min_p, hints)
    if floor_p is None and budget is None:  # the filters keep every token (e.g. top_k >= V)
        return inverse_cdf(probs, uniform_of(keys, PLAIN))
    # NOTE: the per-row bookkeeping (R,) runs in numpy on the tensors' memory (this is the CPU's draw, where a torch
    # op's fixed cost is most of a small op's); the passes over the rows stay torch ops, so the values are the same.
    assert probs.device.type == "cpu", "draw_filtered is the CPU's draw (a device draws with draw_sorted)"
    bounds = _Bounds.of(floor_p, budget, nucleus)
    keys_np = keys.numpy()
    cumulative = probs.cumsum(dim=1)
    total = cumulative[:, -1].numpy()
    x = _search_np(cumulative, total, _uniform_np(keys_np, PLAIN))
    # NOTE: a row without a finite distribution drew V: it stops here, and its token fails it.
    x = np.where(np.isfinite(total) & (total > 0), x, vocab)
    rejected, px, above = bounds.rejected(probs, x)
    if rejected.any():
        _redraw_rejected(x, rejected, px, above, probs, keys_np, bounds, (top_k, top_p, min_p))
    return torch.from_numpy(x)


def _filter_bounds(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, hints: FilterHints
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The rows' bounds for ``draw_filtered``'s test, each (R,) or None when no row has it: ``floor_p``, the p(x)
    a draw must reach (top-k and min-p in one); ``budget``, the most mass above p(x) (top_p times the mass of the
    row's top-k set, 1 without one: not the row's float sum, which would follow the batch); ``nucleus``, the rows
    with a top-p (None: all of them)."""
    floor_p = budget = nucleus = None
    if hints.max_top_k:
        kth = kth_largest(probs, top_k, hints.max_top_k)
        floor_p = torch.maximum(kth, min_p * probs.amax(dim=1)) if hints.any_min_p else kth
        if hints.any_top_p:
            budget = top_p * torch.where(kth > 0, torch.where(probs >= kth[:, None], probs, 0.0).sum(dim=1), 1.0)
    elif hints.any_min_p:
        floor_p = torch.maximum(torch.zeros_like(min_p), min_p * probs.amax(dim=1))
    if hints.any_top_p:
        budget = top_p * 1.0 if budget is None else budget
        nucleus = top_p < 1.0
        if bool(nucleus.all()):  # (this path runs on the CPU, where the read is free) every row has a top-p
            nucleus = None
    return floor_p, budget, nucleus


def _redraw_rejected(
    tokens: np.ndarray,
    rejected: np.ndarray,
    px: np.ndarray,
    above: torch.Tensor | None,
    probs: torch.Tensor,
    keys: np.ndarray,
    bounds: _Bounds,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """``draw_filtered``'s later rounds, writing each rejected row's token into ``tokens`` (R,) in place.

    Round r draws a row again from p above its last rejected draw (the pivot) with ``uniform(seed, position,
    PLAIN + r)``, until its draw is in its set; a row still rejected after ``MAX_ROUNDS - 1`` rounds draws from its
    filtered distribution itself (``filtered_probs`` of ``filters``: top_k, top_p, min_p). ``rejected``, ``px`` and
    ``above``: the first round's ``_Bounds.rejected``; ``keys``: (R,) the rows' ``row_keys``.
    """
    at = np.flatnonzero(rejected)
    index = torch.from_numpy(at)
    pending, p, bounds = at, probs[index], bounds.take(at)
    # the next round's weights: p above the rejected draw's (the top-p test's own pass, when it made one)
    weights = above[index] if above is not None else _above(p, torch.from_numpy(px[at]))
    # Every later round's numbers at once (a few rows).
    u = _uniform_np(keys[at, None], PLAIN + np.arange(1, MAX_ROUNDS + 1))
    for round_ in range(1, MAX_ROUNDS):
        # A rejected row's draw was below its top token, so some token stays above the pivot: the distribution
        # left is finite and positive, and ``inverse_cdf``'s guard for the contrary is not needed.
        cumulative = weights.cumsum(dim=1)
        x = _search_np(cumulative, cumulative[:, -1].numpy(), u[:, round_ - 1])
        rejected, px, above = bounds.rejected(p, x)
        tokens[pending] = x  # a rejected row's is written again by the round that accepts it
        if not rejected.any():
            return
        at = np.flatnonzero(rejected)
        index = torch.from_numpy(at)
        pending, p, u, bounds = pending[at], p[index], u[at], bounds.take(at)
        weights = above[index] if above is not None else _above(p, torch.from_numpy(px[at]))
    rows = torch.from_numpy(pending)
    top_k, top_p, min_p = filters
    rest = filtered_probs(probs[rows], top_k[rows], top_p[rows], min_p[rows])
    tokens[pending] = inverse_cdf(rest, torch.from_numpy(u[:, MAX_ROUNDS - 1])).numpy()


def _search_np(cumulative: torch.Tensor, total: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``_search`` with the (R,) target computed in numpy (the same float32 values): (R,) int64 numpy."""
    target = (u * total.astype(np.float64)).astype(np.float32)
    target = np.minimum(target, np.nextafter(total, np.float32(0)))  # rounding must not reach the total
    found = torch.searchsorted(cumulative, torch.from_numpy(target)[:, None], right=True)
    return found[:, 0].numpy()


@dataclass
class _Bounds:
    """The filters' bounds of the rows still drawing (``draw_filtered``), as float32 / bool numpy (R,) arrays:
    p(x) must reach ``floor_p``; the mass above p(x) must stay below ``budget`` on ``nucleus`` rows (all when
    None). None: no row has that bound."""

    floor_p: np.ndarray | None
    budget: np.ndarray | None
    nucleus: np.ndarray | None

    @classmethod
    def of(cls, floor_p, budget, nucleus) -> _Bounds:
        return cls(*(t.numpy() if t is not None else None for t in (floor_p, budget, nucleus)))

    def take(self, at: np.ndarray) -> _Bounds:
        return _Bounds(*(a[at] if a is not None else None for a in (self.floor_p, self.budget, self.nucleus)))

    def rejected(self, p: torch.Tensor, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None]:
        """((R,) bool numpy: which rows' draws ``x`` (V for a row without a finite distribution: never rejected)
        fall outside their set; (R,) float32 numpy p(x); (R, V) p above p(x), ``_above``, when the top-p test
        computed it (a rejected row's next weights), else None)."""
        vocab = p.shape[1]
        drawn = x < vocab
        px = p.numpy()[np.arange(len(x)), np.minimum(x, vocab - 1)]
        keep = px >= self.floor_p if self.floor_p is not None else None
        above = None
        if self.budget is not None:
            above = _above(p, torch.from_numpy(px))
            inside = above.sum(dim=1).numpy() < self.budget
            if self.nucleus is not None:
                inside |= ~self.nucleus
            keep = inside if keep is None else keep & inside
        assert keep is not None  # some bound applies (``draw_filtered`` checks)
        return drawn & ~keep, px, above


def _above(p: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """``p`` where it exceeds its row's ``bound``, else 0: (R, V) float32 from (R, V) and (R,).

    The values of ``torch.where(p > bound[:, None], p, 0.0)`` on finite rows (p - bound > 0 exactly when
    p > bound, subnormals included), at about a fifth of its cost on a CPU, where it is a round's main pass.
    """
    return p * (p - bound[:, None]).gt_(0)


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
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row from p restricted to its top-k / top-p / min-p set, with no read back from the device:
    the filtered distribution (``filtered_probs`` with the host's hints) and one inverse-CDF draw with
    ``uniform(seed, position, PLAIN)``. The same distribution as ``draw_filtered`` (not the same draws); the
    sampler takes it on a device, where each of ``draw_filtered``'s rounds would wait for the forward pass.

    Returns:
        (R,) int64 tokens (V for a row without a finite distribution, as ``inverse_cdf``).
    """
    kept = filtered_probs(probs, top_k, top_p, min_p, hints)
    u = uniform(seeds, positions, PLAIN) if keys is None else uniform_of(keys, PLAIN)
    return inverse_cdf(kept, u)


# ---- the batch's sampling metadata ----------------------------------------------------------------------------


class TokenCounts:
    """Owns one row per penalised running request, on the device: its output token counts, and which tokens it
    has seen (prompt or output).

    A row is filled from the prompt once, when the request is first sampled with a penalty; afterwards each step
    adds only the tokens output since the last one (one batched scatter for the whole step), so no step loops over
    a request's output. Rows are keyed by ``Request.index`` and freed by ``release``.

    Attributes:
        counts: (rows, V) int32 output token counts.
        seen: (rows, V) bool, the prompt's and the output's tokens.

    Args:
        vocab_size: V.
        device: the logits' device.
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._row_of: dict[int, int] = {}
        self._num_counted: dict[int, int] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._row_of)

    def gather(
        self, requests: list[RowSampling], extra_tokens: list[list[int]] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The rows of ``requests``, brought up to date with their output, plus each entry's extra tokens.

        Args:
            requests: P requests' sampling values (one may appear several times, e.g. once per verified position).
            extra_tokens: per entry, tokens counted as output after the request's own (speculative proposals
                before a verified position, or earlier draft proposals); None for none.

        Returns:
            ((P,) int64 rows of ``counts``; (P, V) bool seen tokens, extra tokens included (a new tensor);
            (P, V) int32 counts of the extra tokens, or None when there are none).
        """
        rows = [self._row(request) for request in requests]
        self._count_new_outputs(requests)
        index = to_device(rows, torch.int64, self.device)
        seen = self.seen[index]
        extra = [(i, t) for i, tokens in enumerate(extra_tokens or ()) for t in tokens]
        if not extra:
            return index, seen, None
        at = to_device(extra, torch.int64, self.device)
        extra_counts = torch.zeros(seen.shape, dtype=torch.int32, device=self.device)
        extra_counts.index_put_(
            (at[:, 0], at[:, 1]), torch.ones(len(extra), dtype=torch.int32, device=self.device), accumulate=True
        )
        seen[at[:, 0], at[:, 1]] = True
        return index, seen, extra_counts

    def count_pending(self, requests: list[RowSampling], sampled: torch.Tensor, rows: list[int]) -> None:
        """Count each request's pending token, still on the device (async batching), so that a penalised row runs
        every step: ``counts[request, sampled[row]] += 1`` on the device, nothing read back. The token is then
        counted: when it reaches the request's output on the host, it is not counted again.

        Args:
            requests: requests with one pending token each (``RowSampling.num_pending`` 1).
            sampled: (S,) int64 on the device, the step in flight's tokens (``StepHandle.sampled``).
            rows: each request's row of ``sampled``.
        """
        todo = []
        for request, row in zip(requests, rows):
            self._row(request)
            if self._num_counted[request.request_index] == request.num_output_tokens:  # not counted yet
                todo.append((request, row))
        self._count_new_outputs([request for request, _ in todo])
        if not todo:
            return
        at = to_device([self._row_of[r.request_index] for r, _ in todo], torch.int64, self.device)
        tokens = sampled[to_device([row for _, row in todo], torch.int64, sampled.device)].to(self.device)
        self.counts.index_put_(
            (at, tokens), torch.ones(len(todo), dtype=torch.int32, device=self.device), accumulate=True
        )
        self.seen[at, tokens] = True
        for request, _ in todo:
            self._num_counted[request.request_index] += 1

    def release(self, request_index: int) -> None:
        """Free the request's row (no-op when it has none)."""
        row = self._row_of.pop(request_index, None)
        if row is not None:
            self._num_counted.pop(request_index)
            self._free.append(row)

    def release_all(self) -> None:
        self._row_of.clear()
        self._num_counted.clear()
        self._free = list(range(self.counts.shape[0]))

    def _row(self, request: RowSampling) -> int:
        index = request.request_index
        row = self._row_of.get(index)
        if row is not None and self._num_counted[index] <= request.position:
            return row
        if row is None:
            row = self._allocate()
            self._row_of[index] = row
        self.counts[row] = 0
        self.seen[row] = False
        self.seen[row, to_device(request.prompt_token_ids, torch.int64, self.device)] = True
        self._num_counted[index] = 0
        return row

    def _allocate(self) -> int:
        if not self._free:
            old = self.counts.shape[0]
            new = max(8, 2 * old)
            self.counts = torch.cat((self.counts, self.counts.new_zeros(new - old, self.vocab_size)))
            self.seen = torch.cat((self.seen, self.seen.new_zeros(new - old, self.vocab_size)))
            self._free = list(range(new - 1, old - 1, -1))
        return self._free.pop()

    def _count_new_outputs(self, requests: list[RowSampling]) -> None:
        rows, tokens, counted = [], [], {}
        for request in {r.request_index: r for r in requests}.values():  # each request once
            index = request.request_index
            done = self._num_counted[index]
            new = request.output_token_ids[done : request.num_output_tokens]
            if new:
                rows += [self._row_of[index]] * len(new)
                tokens += new
                counted[index] = done + len(new)
        if rows:
            at = to_device([rows, tokens], torch.int64, self.device)
            self.counts.index_put_(
                (at[0], at[1]), torch.ones(len(rows), dtype=torch.int32, device=self.device), accumulate=True
            )
            self.seen[at[0], at[1]] = True
        self._num_counted.update(counted)  # only once counted: a failed update is redone by the next call


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
    """The settings of R rows (vLLM v1's ``SamplingMetadata``): per-row tensors on the logits' device, per-row host
    arrays, and the batch's predicates, each computed once (P: the rows with a penalty).

    Attributes:
        temperature: (R,) float32 (1 on greedy rows); top_k: int64 (0 off); top_p, min_p: float32.
        seeds, positions: (R,) int64 stream keys and output positions (``uniform``); keys: (R,) int64 their
            ``row_keys`` (``uniform_of(keys, draw)`` is ``uniform(seeds, positions, draw)``), made on first use;
            seed_hashes: (R,) uint64 numpy ``seed_hash`` of each row's seed; host_positions: (R,) int64 numpy, the
            positions on the host.
        penalty_rows: (P,) int64 or None (no row is penalised); count_rows: (P,) int64 rows of
            ``TokenCounts.counts``; seen: (P, V) bool; extra_counts: (P, V) int32 or None (``TokenCounts.gather``);
            repetition, presence, frequency: (P,) float32.
        token_counts: the ``TokenCounts`` the rows were gathered from.
        stop_rows, stop_tokens: int64 (row, token) pairs masked by ``min_new_tokens``, or None.
        greedy_rows: (R,) bool numpy, the rows that take the argmax; num_logprobs: (R,) int64 numpy, the top
            log-probabilities each row asks for (-1: off); processed_logprobs: (R,) bool numpy, ``logprobs_mode`` is
            "processed_logprobs".
        any_sampled, all_sampled, any_filtered, any_logprobs, any_raw_logprobs: host flags (skip work no row needs,
            without waiting for the device).
        filter_hints: what the host knows of the sampled rows' filters (``FilterHints``).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    seed_hashes: np.ndarray
    host_positions: np.ndarray
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
    greedy_rows: np.ndarray
    num_logprobs: np.ndarray
    processed_logprobs: np.ndarray
    any_sampled: bool
    all_sampled: bool
    any_filtered: bool
    any_logprobs: bool
    any_raw_logprobs: bool
    filter_hints: FilterHints
    _keys: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return len(self.greedy_rows)

    @property
    def keys(self) -> torch.Tensor:
        """(R,) int64 ``row_keys`` of the rows on the positions' device (the CPU's C draw takes the seed hashes and
        positions themselves, so it is made only when another draw asks)."""
        if self._keys is None:
            keys = _mix_np(self.seed_hashes + self.host_positions.view(np.uint64)).view(np.int64)
            self._keys = _upload(keys, self.positions.device)
        return self._keys


#: ``SamplingSlots``' per-request arrays and their dtypes.
_SLOT_FIELDS = {
    "temperature": np.float32,  # 1 on greedy rows
    "top_k": np.int64,
    "top_p": np.float32,
    "min_p": np.float32,
    "seed": np.int64,  # stream_key(seed)
    "seed_hash": np.uint64,  # seed_hash(seed), as unsigned bits
    "greedy": np.bool_,
    "filtered": np.bool_,
    "penalised": np.bool_,
    "masked_greedy": np.bool_,
    "num_logprobs": np.int64,  # -1: off
    "processed": np.bool_,
    "min_new_tokens": np.int64,
    "repetition": np.float32,
    "presence": np.float32,
    "frequency": np.float32,
    "prompt_length": np.int64,
}


@dataclass
class _Gathered:
    """The per-request part of a ``SamplingBatch`` for one list of slots (it changes only when a request joins or
    leaves the step's rows, so it is kept from step to step)."""

    slots: list[int]
    device: torch.device
    at: np.ndarray
    seed_hash: np.ndarray
    prompt_length: np.ndarray
    min_new_tokens: np.ndarray | None
    penalised: np.ndarray
    tensors: dict[str, torch.Tensor]
    greedy_rows: np.ndarray
    num_logprobs: np.ndarray
    processed_logprobs: np.ndarray
    flags: _BatchFlags
    filter_hints: FilterHints


class _BatchFlags(TypedDict):
    """A ``SamplingBatch``'s host flags (its attributes of these names)."""

    any_sampled: bool
    all_sampled: bool
    any_filtered: bool
    any_logprobs: bool
    any_raw_logprobs: bool


class SamplingSlots:
    """Each request's sampling settings in a row of persistent host arrays, written once, when the request is first
    sampled, and gathered for every step's rows: a step reads its rows' settings with a few array gathers (kept as
    they are while the step's rows stay the same), never with a Python loop over their ``SamplingParams`` (vLLM v1's
    ``InputBatch`` keeps temperature, top_p, top_k and the generators so). The row predicates (greedy, filtered,
    penalised) are evaluated here, once per request, from their one definition on ``SamplingParams``.

    Owned by ``StepSampler``, which frees a finished request's slot (``release``); ``build_batch`` without slots
    makes a temporary one.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.slot_of: dict[int, int] = {}  # Request.index -> slot
        self.params: list[SamplingParams | None] = []
        self.arrays: dict[str, np.ndarray] = {name: np.zeros(0, dtype=dtype) for name, dtype in _SLOT_FIELDS.items()}
        self._free: list[int] = []
        self._gathered: _Gathered | None = None
        self._grow(capacity)

    def __len__(self) -> int:
        return len(self.slot_of)

    def release(self, request_index: int) -> None:
        """Free the request's slot (no-op when it has none)."""
        slot = self.slot_of.pop(request_index, None)
        if slot is not None:
            self.params[slot] = None
            self._free.append(slot)
            self._gathered = None

    def release_all(self) -> None:
        self.slot_of.clear()
        self.params = [None] * len(self.params)
        self._free = list(range(len(self.params) - 1, -1, -1))
        self._gathered = None

    def slots(self, values: list[RowSampling]) -> list[int]:
        """Each row's slot, a request seen for the first time given one."""
        indices = [v.request_index for v in values]
        try:
            return list(map(self.slot_of.__getitem__, indices))
        except KeyError:
            for value in values:
                if value.request_index not in self.slot_of:
                    self._join(value)
            return list(map(self.slot_of.__getitem__, indices))

    def flag(self, value: RowSampling, name: str) -> bool:
        """One row predicate of the request (``"greedy"``, ``"penalised"``, ``"masked_greedy"``, ...), as evaluated
        when it joined."""
        if value.request_index not in self.slot_of:
            self._join(value)
        return bool(self.arrays[name][self.slot_of[value.request_index]])

    def any_flag(self, values: list[RowSampling], name: str) -> bool:
        """Whether some row's predicate ``name`` holds (``flag`` of each)."""
        slots = self.slots(values)  # first: a new request's slot may grow the arrays
        return bool(self.arrays[name][slots].any())

    def penalised(self, values: list[RowSampling], slots: list[int] | None = None) -> list[int]:
        """The positions in ``values`` of the penalised rows (``slots``: theirs, when the caller has them)."""
        kept = self._gathered
        if slots is not None and kept is not None and kept.slots is slots:  # the rows of the last batch
            return kept.penalised.tolist()
        if slots is None:
            slots = self.slots(values)  # first: a new request's slot may grow the arrays
        return np.flatnonzero(self.arrays["penalised"][slots]).tolist()

    def _join(self, value: RowSampling) -> None:
        if not self._free:
            self._grow(max(64, 2 * len(self.params)))
        slot = self._free.pop()
        self.slot_of[value.request_index] = slot
        p = value.params
        self.params[slot] = p
        greedy = p.greedy
        row = {
            "temperature": 1.0 if greedy else p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "min_p": p.min_p,
            "seed": stream_key(value.seed),
            "seed_hash": seed_hash(value.seed) & _MASK64,
            "greedy": greedy,
            "filtered": p.filtered,
            "penalised": p.penalised,
            "masked_greedy": p.masked_greedy,
            "num_logprobs": -1 if p.logprobs is None else p.logprobs,
            "processed": p.logprobs_mode == "processed_logprobs",
            "min_new_tokens": p.min_new_tokens,
            "repetition": p.repetition_penalty,
            "presence": p.presence_penalty,
            "frequency": p.frequency_penalty,
            "prompt_length": len(value.prompt_token_ids),
        }
        with np.errstate(over="ignore"):  # a setting past float32's range is inf there, as torch casts it
            for name, array in self.arrays.items():
                array[slot] = row[name]

    def _grow(self, capacity: int) -> None:
        old = len(self.params)
        for name, array in self.arrays.items():
            grown = np.zeros(capacity, dtype=array.dtype)
            grown[:old] = array
            self.arrays[name] = grown
        self.params.extend([None] * (capacity - old))
        self._free.extend(range(capacity - 1, old - 1, -1))

    def _gather(self, slots: list[int], vocab_size: int, device: torch.device) -> _Gathered:
        """The rows' settings: kept from the last call when its slots were the same, in the same order."""
        kept = self._gathered
        if kept is not None and kept.device == device and (kept.slots is slots or kept.slots == slots):
            return kept
        at = np.array(slots, dtype=np.int64)
        a = self.arrays
        greedy = a["greedy"][at]
        sampled = ~greedy
        top_k, top_p, min_p = a["top_k"][at], a["top_p"][at], a["min_p"][at]
        num_logprobs, processed = a["num_logprobs"][at], a["processed"][at]
        k = top_k[sampled]
        hints = FilterHints(
            int(k[(k > 0) & (k < vocab_size)].max(initial=0)),
            bool((top_p[sampled] < 1.0).any()),
            bool((min_p[sampled] > 0.0).any()),
        )
        min_new = a["min_new_tokens"][at]
        asks = num_logprobs >= 0
        gathered = _Gathered(
            slots=slots,
            device=device,
            at=at,
            seed_hash=a["seed_hash"][at],
            prompt_length=a["prompt_length"][at],
            min_new_tokens=min_new if min_new.any() else None,
            penalised=np.flatnonzero(a["penalised"][at]),
            tensors={
                "temperature": _upload(a["temperature"][at], device),
                "top_k": _upload(top_k, device),
                "top_p": _upload(top_p, device),
                "min_p": _upload(min_p, device),
                "seeds": _upload(a["seed"][at], device),
            },
            greedy_rows=greedy,
            num_logprobs=num_logprobs,
            processed_logprobs=processed,
            flags={
                "any_sampled": bool(sampled.any()),
                "all_sampled": bool(sampled.all()),
                "any_filtered": bool(a["filtered"][at].any()),
                "any_logprobs": bool(asks.any()),
                "any_raw_logprobs": bool((asks & ~processed).any()),
            },
            filter_hints=hints,
        )
        self._gathered = gathered
        return gathered

    def batch(
        self,
        values: list[RowSampling],
        extra_tokens: list[list[int]] | None,
        token_counts: TokenCounts,
        eos_token_ids: frozenset[int],
        device: torch.device | str,
        ends: np.ndarray | None = None,
        slots: list[int] | None = None,
    ) -> SamplingBatch:
        """The ``SamplingBatch`` of rows of these requests (``extra_tokens``: per row, the tokens counted as output
        after its request's own, or None for none); penalised rows' counts are gathered from ``token_counts``.

        ``ends``: (R,) int64 each row's context end at its step (``ScheduledRequest`` start + tokens, no
        proposals): its position is that less its prompt's length, whatever the values' own (the values sent with
        the request's first plan; a penalised row's must be the step's, ``RowSampling.at``, since its counts read
        them). None: the positions of the values (``RowSampling.position``). ``slots``: the rows' slots, when the
        caller has them (``slots``).
        """
        device = torch.device(device)
        fixed = self._gather(slots if slots is not None else self.slots(values), token_counts.vocab_size, device)
        if ends is not None:
            positions = ends - fixed.prompt_length
        else:
            positions = np.fromiter((v.num_output_tokens + v.num_pending for v in values), np.int64, len(values))
        if extra_tokens is not None:
            positions += np.fromiter(map(len, extra_tokens), np.int64, len(values))
        penalties = self._penalties(fixed, values, extra_tokens, token_counts, device)
        stop_rows, stop_tokens = self._min_new_tokens_stops(fixed, positions, eos_token_ids, device)
        t = fixed.tensors
        return SamplingBatch(
            temperature=t["temperature"],
            top_k=t["top_k"],
            top_p=t["top_p"],
            min_p=t["min_p"],
            seeds=t["seeds"],
            positions=_upload(positions, device),
            seed_hashes=fixed.seed_hash,
            host_positions=positions,
            token_counts=token_counts,
            stop_rows=stop_rows,
            stop_tokens=stop_tokens,
            greedy_rows=fixed.greedy_rows,
            num_logprobs=fixed.num_logprobs,
            processed_logprobs=fixed.processed_logprobs,
            filter_hints=fixed.filter_hints,
            **penalties._asdict(),
            **fixed.flags,
        )

    def _penalties(
        self,
        fixed: _Gathered,
        values: list[RowSampling],
        extra_tokens: list[list[int]] | None,
        token_counts: TokenCounts,
        device: torch.device,
    ) -> _Penalties:
        """The penalised rows' token counts (gathered from ``token_counts``) and penalty values on ``device``."""
        if not len(fixed.penalised):
            return _Penalties()
        rows = fixed.penalised.tolist()
        count_rows, seen, extra_counts = token_counts.gather(
            [values[i] for i in rows], [extra_tokens[i] for i in rows] if extra_tokens is not None else None
        )
        at = fixed.at[fixed.penalised]
        penalty_rows = _upload(fixed.penalised.astype(np.int64), device)
        a = self.arrays
        repetition, presence, frequency = (_upload(a[n][at], device) for n in ("repetition", "presence", "frequency"))
        return _Penalties(penalty_rows, count_rows, seen, extra_counts, repetition, presence, frequency)

    def _min_new_tokens_stops(
        self, fixed: _Gathered, positions: np.ndarray, eos_token_ids: frozenset[int], device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(row, token) pairs ``min_new_tokens`` masks at the rows' ``positions`` (their stop tokens while short
        of it), as two int64 tensors on ``device``, or (None, None) when no row is short of its minimum."""
        if fixed.min_new_tokens is None:
            return None, None
        pairs = [
            (i, t)
            for i in np.flatnonzero(positions < fixed.min_new_tokens).tolist()
            for t in _stop_tokens(self.params[fixed.slots[i]], eos_token_ids)
        ]
        if not pairs:
            return None, None
        stop_rows = _upload(np.array([i for i, _ in pairs], dtype=np.int64), device)
        stop_tokens = _upload(np.array([t for _, t in pairs], dtype=np.int64), device)
        return stop_rows, stop_tokens


class _Penalties(NamedTuple):
    """The penalised rows' part of a ``SamplingBatch`` (its attributes of these names); all None without one."""

    penalty_rows: torch.Tensor | None = None
    count_rows: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    extra_counts: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None


def _stop_tokens(params: SamplingParams | None, eos_token_ids: frozenset[int]) -> list[int]:
    """The tokens ``min_new_tokens`` masks: the row's stop tokens, and the EOS ids unless it ignores them."""
    assert params is not None  # a row's slot holds its params while it runs
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)))


def _mix_np(x: np.ndarray) -> np.ndarray:
    """``mix64`` over uint64 numpy values (unsigned arithmetic wraps modulo 2**64, as torch's int64 does)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without making the host wait (``to_device``'s rule: page-locked and
    non-blocking on CUDA; on the CPU the array itself, which nothing writes afterwards)."""
    tensor = torch.from_numpy(values)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor.to(device)


def build_batch(
    rows: list[SamplingRow],
    token_counts: TokenCounts,
    eos_token_ids: frozenset[int],
    device: torch.device | str,
    slots: SamplingSlots | None = None,
) -> SamplingBatch:
    """The ``SamplingBatch`` of ``rows`` (``SamplingSlots.batch``; penalised rows' counts gathered).

    Args:
        rows: the step's rows in logits order.
        token_counts: the penalised requests' counts (rows are created and updated here).
        eos_token_ids: the model's EOS ids (masked with the stop tokens while ``min_new_tokens`` is unmet).
        device: the logits' device.
        slots: the requests' persistent settings (``StepSampler``'s); None gathers them into temporary ones.
    """
    slots = slots if slots is not None else SamplingSlots(len(rows))
    extra = [row.extra_tokens for row in rows]
    return slots.batch(
        [row.request for row in rows], extra if any(extra) else None, token_counts, eos_token_ids, device
    )


# ---- the sampler --------------------------------------------------------------------------------------------


@dataclass
class SamplerOutput:
    """One step's results on the device.

    Attributes:
        tokens: (R,) int64, the chosen token of each row, always in ``[0, V)`` (0 where ``errors`` is not 0:
            ``check_tokens``).
        errors: (R,) int8 codes (``OK``, ``NAN_LOGITS``, ``NOTHING_LEFT``, ``OUT_OF_VOCAB``).
        logprob_rows: host list of the L rows that asked for log-probabilities.
        chosen: (L,) float32 log-probability of each such row's token.
        top_values, top_indices: (L, max logprobs) float32 / int64, the top log-probabilities.
        encoded: ``readback()``'s value when the draw made it already (the CPU kernel's), else None.
    """

    tokens: torch.Tensor
    errors: torch.Tensor
    logprob_rows: list[int]
    num_logprobs: list[int]
    chosen: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_indices: torch.Tensor | None = None
    encoded: torch.Tensor | None = None

    def _packed_logprobs(self) -> torch.Tensor:
        """(L, 1 + 2 * max logprobs) float64 on the device: chosen, top values, top ids (exact in float64)."""
        assert self.chosen is not None and self.top_values is not None and self.top_indices is not None
        parts = (self.chosen[:, None], self.top_values, self.top_indices)
        return torch.cat([t.double() for t in parts], dim=1)

    def logprob_bits(self) -> torch.Tensor | None:
        """The log-probabilities packed for the step's read-back (``float_bits`` of
        ``_packed_logprobs``), so they reach the host in the tokens' copy; None when no row asked."""
        return float_bits(self._packed_logprobs()) if self.logprob_rows else None

    def readback(self) -> torch.Tensor:
        """(R,) int64 on the device: the tokens, with each failed row's error code folded in as a negative id
        (``encode_errors``), so one copy brings both to the host."""
        return self.encoded if self.encoded is not None else encode_errors(self.tokens, self.errors)

    def to_host(
        self, read_back: list[int] | None = None, logprob_bits: list[int] | None = None
    ) -> tuple[list[int], list[str | None], list[dict[int, float] | None]]:
        """(tokens, per-row error message or None, per-row log-probabilities or None).

        Args:
            read_back: ``readback()`` as already copied to the host with the step's tokens; None reads it now
                (one device read).
            logprob_bits: ``logprob_bits()`` as copied to the host in the same read-back; None reads the
                log-probabilities now (a further device read) when any row asked.
        """
        if read_back is None:
            read_back = self.readback().tolist()
        errors = [decode_error(t) for t in read_back]
        tokens = [max(t, 0) for t in read_back]
        logprobs: list[dict[int, float] | None] = [None] * len(tokens)
        if self.logprob_rows:
            # NOTE: one read for all three: the ids ride as float64 (exact far beyond any vocabulary size).
            flat = floats_of(logprob_bits) if logprob_bits is not None else self._packed_logprobs().view(-1).tolist()
            assert self.top_values is not None  # set with ``logprob_rows``
            width = self.top_values.shape[1]
            stride = 1 + 2 * width
            for j, (row, num) in enumerate(zip(self.logprob_rows, self.num_logprobs)):
                packed = flat[j * stride : (j + 1) * stride]
                entry = {tokens[row]: packed[0]}
                entry.update(zip((int(i) for i in packed[1 + width : 1 + width + num]), packed[1 : 1 + num]))
                logprobs[row] = entry
        return tokens, errors, logprobs


def process(
    logits: torch.Tensor, batch: SamplingBatch, token_bitmask: torch.Tensor | None = None, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Scores of every row before temperature and filters.

    Args:
        logits: (R, V) any float dtype, on any device.
        batch: the rows' settings.
        token_bitmask: (R, ceil(V / 32)) int32 in xgrammar's layout (bit j of word i: token 32 i + j allowed), or
            None when no row is constrained. Disallowed tokens become -inf before anything else.
        in_place: ``logits`` is the caller's own copy (float32 logits are then processed in place, one pass
            fewer).

    Returns:
        (scores (R, V) float32 after penalties, finite or -inf except on failed rows; raw (L, V) float32 scores
        of the L rows that ask for raw log-probabilities, in row order, or None; (R,) int8 error codes).
    """
    return _process(logits, batch, token_bitmask, in_place)[:3]


def _process(
    logits: torch.Tensor, batch: SamplingBatch, token_bitmask: torch.Tensor | None, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """``process``, and each row's maximum score when it is known without another pass (``_settle``)."""
    scores = logits.to(torch.float32, copy=not in_place)
    if token_bitmask is not None:
        apply_token_bitmask(scores, token_bitmask)
    raw = None
    if batch.any_raw_logprobs:  # only the rows that ask, before the penalties change them
        raw_rows = np.flatnonzero((batch.num_logprobs >= 0) & ~batch.processed_logprobs)
        raw = scores.clone() if len(raw_rows) == len(batch) else scores[_upload(raw_rows, scores.device)]
    apply_stop_mask(scores, batch.stop_rows, batch.stop_tokens)
    if batch.penalty_rows is not None:
        assert batch.count_rows is not None and batch.seen is not None  # gathered with the penalty rows
        assert batch.repetition is not None and batch.presence is not None and batch.frequency is not None
        apply_penalties(
            scores,
            batch.penalty_rows,
            batch.token_counts.counts,
            batch.count_rows,
            batch.seen,
            batch.extra_counts,
            batch.repetition,
            batch.presence,
            batch.frequency,
        )
    errors, top = _settle(scores)
    # A failed row is dropped by its caller; zeros keep the batched ops below free of NaN. On the CPU the check is
    # free and skips a pass; on a device it would wait for the forward pass, so the fill is unconditional there.
    # (A failed row's maximum in ``top`` is then stale: only its own dropped draw reads it.)
    if waits_for_device(scores.device) or bool(errors.any()):
        scores.masked_fill_((errors != 0)[:, None], 0.0)
    return scores, raw, errors, top


def sampled_rows(batch: SamplingBatch, device) -> torch.Tensor:
    """(S,) int64 indices of the batch's sampled (not greedy) rows, built on the host (no device sync)."""
    return _upload(np.flatnonzero(~batch.greedy_rows), torch.device(device))


def _index(rows: list[int], device) -> torch.Tensor:
    return to_device(rows, torch.int64, device)


def sampled_probs(
    scores: torch.Tensor,
    batch: SamplingBatch,
    rows: torch.Tensor | None = None,
    filtered: bool = True,
    top: torch.Tensor | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """softmax(scores / temperature) of ``rows`` (all when None), filtered when ``filtered`` (``filtered_probs``).

    ``top``: the rows' (R,) maximum scores when the caller has them (else computed); ``in_place``: ``scores`` may
    be overwritten (the caller's copy): the same values, one tensor fewer.
    """
    temperature = batch.temperature if rows is None else batch.temperature[rows]
    # NOTE: the row's maximum comes off before the temperature divides: scores / temperature can overflow float32
    # (penalised scores near 1e38, or a temperature near 1e-5), and softmax of an inf row is NaN. The shifted scores
    # are <= 0, so the quotient is at worst -inf, and the distribution is the same (softmax is shift-invariant).
    top = scores.amax(dim=1, keepdim=True) if top is None else top[:, None]
    if in_place:
        probs = torch.softmax(scores.sub_(top).div_(temperature[:, None]), dim=1)
    else:
        probs = torch.softmax((scores - top) / temperature[:, None], dim=1)
    if not filtered:
        return probs
    pick = (lambda t: t) if rows is None else (lambda t: t[rows])
    hints = batch.filter_hints if waits_for_device(scores.device) else None  # the batch's: a superset's are fine
    return filtered_probs(probs, pick(batch.top_k), pick(batch.top_p), pick(batch.min_p), hints)


def sample(
    logits: torch.Tensor, batch: SamplingBatch, token_bitmask: torch.Tensor | None = None, in_place: bool = False
) -> SamplerOutput:
    """Choose one token per row, greedy and sampled rows together.

    On the CPU (float32 logits) the sampled rows are drawn by our C kernel (``cbrun.kernels.cpu_sampler``: the
    whole draw of every row in one call); a step whose rows are all sampled and need no processing (no bitmask,
    penalties, stop tokens or log-probabilities: e.g. Llama-3's defaults) hands the kernel the logits as they are.
    Elsewhere, and where the kernel cannot be built, the PyTorch draw (``draw_filtered`` on the CPU, ``draw_sorted``
    on a device).

    Args:
        logits: (R, V) logits of any float dtype on the device; R == len(batch).
        batch: the rows' settings (``build_batch``).
        token_bitmask, in_place: see ``process``.

    Returns:
        The device-side results (``SamplerOutput.to_host`` reads them). A row with NaN logits, or with every token
        ruled out, gets an error code; the other rows are unaffected.
    """
    if _unprocessed(batch, token_bitmask) and cpu_sampler.supports(logits):
        # NOTE: the kernel checks the rows' scores itself (NaN, all -inf, +inf): no processing pass, no copy.
        return _draw_cpu(logits, batch, None, None)
    scores, raw, errors, top = _process(logits, batch, token_bitmask, in_place)
    if batch.any_sampled and cpu_sampler.supports(scores):
        if batch.all_sampled:
            out = _draw_cpu(scores, batch, None, errors)
        else:
            out = _draw_cpu(scores, batch, np.flatnonzero(~batch.greedy_rows), errors, scores.argmax(dim=1))
        return with_logprobs(out, scores, raw, batch)
    tokens = _draw_torch(scores, batch, top)
    check_tokens(tokens, errors, scores.shape[1])
    return with_logprobs(SamplerOutput(tokens, errors, [], []), scores, raw, batch)


def _unprocessed(batch: SamplingBatch, token_bitmask: torch.Tensor | None) -> bool:
    """Every row is sampled and needs no processing (no bitmask, stop tokens, penalties or log-probabilities): the
    CPU's C draw may take the logits as they are."""
    return (
        batch.all_sampled
        and token_bitmask is None
        and batch.stop_rows is None
        and batch.penalty_rows is None
        and not batch.any_logprobs
    )


def _draw_torch(scores: torch.Tensor, batch: SamplingBatch, top: torch.Tensor | None) -> torch.Tensor:
    """(R,) int64 each row's token by the PyTorch draw (greedy rows their argmax) from ``process``'s scores (``top``:
    their row maxima when known); not yet checked (``check_tokens``)."""
    all_sampled = batch.all_sampled
    tokens = None if all_sampled else scores.argmax(dim=1)
    if batch.any_sampled:
        rows = None if all_sampled else sampled_rows(batch, scores.device)
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        if rows is None:  # the scores themselves, unless the log-probabilities read them afterwards
            probs = sampled_probs(scores, batch, None, False, top, in_place=not batch.any_logprobs)
        else:
            probs = sampled_probs(scores[rows], batch, rows, False, pick(top) if top is not None else None, True)
        keys = pick(batch.keys)
        if batch.any_filtered:
            top_k, top_p, min_p = pick(batch.top_k), pick(batch.top_p), pick(batch.min_p)
            seeds, positions, hints = pick(batch.seeds), pick(batch.positions), batch.filter_hints
            # NOTE: on a device the rejection rounds would each wait for the forward pass: one sort instead.
            if waits_for_device(scores.device):
                drawn = draw_sorted(probs, top_k, top_p, min_p, seeds, positions, hints, keys)
            else:
                drawn = draw_filtered(probs, top_k, top_p, min_p, seeds, positions, hints, keys)
        else:
            drawn = inverse_cdf(probs, uniform_of(keys, PLAIN))
        if tokens is None:  # every row sampled
            tokens = drawn
        else:
            tokens[rows] = drawn
    assert tokens is not None  # a row is greedy or sampled
    return tokens


_KERNEL_SETTINGS = ("temperature", "top_k", "top_p", "min_p")


def _draw_cpu(
    scores: torch.Tensor,
    batch: SamplingBatch,
    rows: np.ndarray | None,
    errors: torch.Tensor | None,
    tokens: torch.Tensor | None = None,
) -> SamplerOutput:
    """The sampled rows drawn by the C kernel (``cbrun.kernels.cpu_sampler``), on the host arrays behind the
    batch's CPU tensors.

    Args:
        scores: (R, V) float32 CPU scores.
        rows: the sampled rows (None: all of them).
        errors: (R,) int8 codes of the processing (a failed row keeps its own), or None (no processing ran).
        tokens: (R,) int64 greedy rows' tokens (their argmax), written in place; None when every row is sampled.
    """
    settings = [getattr(batch, name).numpy() for name in _KERNEL_SETTINGS] + [batch.seed_hashes, batch.host_positions]
    if rows is not None:
        settings = [values[rows] for values in settings]
    temperature, top_k, top_p, min_p, seed_hashes, positions = settings
    num_rows = scores.shape[0] if rows is None else len(rows)
    threads = 1 if num_rows < 64 else torch.get_num_threads()
    drawn = cpu_sampler.sample_rows(scores, rows, temperature, top_k, top_p, min_p, seed_hashes, positions, threads)
    if errors is None and tokens is None:  # the fast path: the kernel's read-back is the row's, errors folded in
        codes = drawn.numpy()
        if codes.min(initial=0) >= 0:  # no row failed
            return SamplerOutput(drawn, torch.zeros(num_rows, dtype=torch.int8), [], [], encoded=drawn)
        failed = codes < 0
        code = torch.from_numpy(np.where(failed, -1 - codes, 0).astype(np.int8))
        return SamplerOutput(torch.from_numpy(np.where(failed, 0, codes)), code, [], [], encoded=drawn)
    if errors is None:
        errors = torch.zeros(scores.shape[0], dtype=torch.int8)
    index = None if rows is None else torch.from_numpy(rows)
    own = (-1 - drawn).clamp_(min=0).to(torch.int8)  # the kernel's codes (0 for a drawn token)
    if index is None:
        errors = torch.where(errors != OK, errors, own)
        tokens = drawn.clamp(min=0)
    else:
        assert tokens is not None  # the greedy rows' argmax
        errors[index] = torch.where(errors[index] != OK, errors[index], own)
        tokens[index] = drawn.clamp(min=0)
    check_tokens(tokens, errors, scores.shape[1])
    return SamplerOutput(tokens, errors, [], [])


def with_logprobs(
    out: SamplerOutput, scores: torch.Tensor, raw: torch.Tensor | None, batch: SamplingBatch
) -> SamplerOutput:
    """Fill the log-probabilities asked for: one ``log_softmax`` per kind of row, then one ``topk``.

    Args:
        out: the chosen tokens and error codes.
        scores, raw: ``process``'s.
        batch: the rows' settings.
    """
    if not batch.any_logprobs:
        return out
    rows = np.flatnonzero(batch.num_logprobs >= 0).tolist()
    greedy, processed = batch.greedy_rows, batch.processed_logprobs
    kinds = ["raw" if not processed[i] else "greedy" if greedy[i] else "sampled" for i in rows]
    parts = []
    for kind in ("raw", "greedy", "sampled"):
        js = [j for j, k in enumerate(kinds) if k == kind]
        if not js:
            continue
        if kind == "raw":
            assert raw is not None  # ``process`` keeps the raw rows when some row asks for them
            settle_infinities(raw)
            values = torch.log_softmax(raw, dim=1)
        else:
            at = _index([rows[j] for j in js], scores.device)
            values = (
                torch.log_softmax(scores[at], dim=1)
                if kind == "greedy"
                else torch.log(sampled_probs(scores[at], batch, at))
            )
        parts.append((js, values))
    if len(parts) == 1:
        logprobs = parts[0][1]
    else:
        logprobs = torch.empty(len(rows), scores.shape[1], dtype=torch.float32, device=scores.device)
        for js, values in parts:
            logprobs[_index(js, scores.device)] = values
    num = [int(batch.num_logprobs[i]) for i in rows]
    top = torch.topk(logprobs, min(max(num), logprobs.shape[1]), dim=1)
    chosen = logprobs.gather(1, out.tokens[_index(rows, scores.device)][:, None])[:, 0]
    return SamplerOutput(out.tokens, out.errors, rows, num, chosen, top.values, top.indices, out.encoded)


def float_bits(values: torch.Tensor) -> torch.Tensor:
    """(numel,) int64 on ``values``' device: ``values`` as float64 (exact for float32 and for integers below
    2**53), flattened, their bit patterns reinterpreted, so they ride in the step's int64 read-back."""
    return values.to(torch.float64).reshape(-1).view(torch.int64)


def floats_of(bits: list[int]) -> list[float]:
    """The float64 values of ``float_bits`` patterns read back to the host (no device involved)."""
    return torch.tensor(bits, dtype=torch.int64).view(torch.float64).tolist() if bits else []
