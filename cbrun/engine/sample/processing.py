"""Logits to scores for a whole step: token bitmask, minimum-length stops, penalties, the inf/NaN rules.

Every function works on (R, V) tensors on the logits' device, R being the step's sampled rows; a row's result
depends on its own logits and settings only.
"""

from __future__ import annotations

import torch

from cbrun.engine.worker.device import waits_for_device
from cbrun.kernels import cpu_token_mask

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
            xgrammar = None
        if xgrammar is not None:
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
    top = scores.amax(dim=1)  # NaN where the row holds NaN
    nan = top.isnan()
    inf_rows = top == float("inf")
    if waits_for_device(scores.device):  # no host read of the device (it would wait for the forward pass)
        settled = torch.where(scores == float("inf"), 0.0, float("-inf"))
        scores.copy_(torch.where(inf_rows[:, None], settled, scores))
    elif bool(inf_rows.any()):
        sub = scores[inf_rows]
        scores[inf_rows] = torch.where(sub == float("inf"), 0.0, float("-inf"))
    errors = torch.zeros(scores.shape[0], dtype=torch.int8, device=scores.device)
    errors.masked_fill_(top == float("-inf"), NOTHING_LEFT)
    return errors.masked_fill_(nan, NAN_LOGITS)


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
