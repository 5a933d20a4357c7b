"""The step's sampler: every sampled row of a step in one pass of tensor ops on the logits' device.

Per row, in order (vLLM's sampler and transformers' logits processors use the same order): the token bitmask
(structured output), ``min_new_tokens`` (stop tokens masked), repetition penalty, presence and frequency
penalties; the inf/NaN rules; raw log-probabilities are read before the penalties, processed ones after the
filters. Greedy rows then take the argmax; sampled rows divide by their temperature, take the softmax and draw
from their top-k / top-p / min-p set (``filters.draw_filtered``) with their own counter-based random stream. Only
the tokens, the per-row error codes and the log-probabilities asked for ever leave the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbrun.engine.sample import processing, random_stream
from cbrun.engine.sample.batch import SamplingBatch
from cbrun.engine.sample.filters import draw_filtered, draw_sorted, filtered_probs, inverse_cdf
from cbrun.engine.worker.async_batching import float_bits, floats_of
from cbrun.engine.worker.device import to_device, waits_for_device


@dataclass
class SamplerOutput:
    """One step's results on the device.

    Attributes:
        tokens: (R,) int64, the chosen token of each row, always in ``[0, V)`` (0 where ``errors`` is not 0:
            ``processing.check_tokens``).
        errors: (R,) int8 codes (``processing.OK``, ``NAN_LOGITS``, ``NOTHING_LEFT``, ``OUT_OF_VOCAB``).
        logprob_rows: host list of the L rows that asked for log-probabilities.
        chosen: (L,) float32 log-probability of each such row's token.
        top_values, top_indices: (L, max logprobs) float32 / int64, the top log-probabilities.
    """

    tokens: torch.Tensor
    errors: torch.Tensor
    logprob_rows: list[int]
    num_logprobs: list[int]
    chosen: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_indices: torch.Tensor | None = None

    def _packed_logprobs(self) -> torch.Tensor:
        """(L, 1 + 2 * max logprobs) float64 on the device: chosen, top values, top ids (exact in float64)."""
        parts = (self.chosen[:, None], self.top_values, self.top_indices)
        return torch.cat([t.double() for t in parts], dim=1)

    def logprob_bits(self) -> torch.Tensor | None:
        """The log-probabilities packed for the step's read-back (``async_batching.float_bits`` of
        ``_packed_logprobs``), so they reach the host in the tokens' copy; None when no row asked."""
        return float_bits(self._packed_logprobs()) if self.logprob_rows else None

    def readback(self) -> torch.Tensor:
        """(R,) int64 on the device: the tokens, with each failed row's error code folded in as a negative id
        (``processing.encode_errors``), so one copy brings both to the host."""
        return processing.encode_errors(self.tokens, self.errors)

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
        errors = [processing.decode_error(t) for t in read_back]
        tokens = [max(t, 0) for t in read_back]
        logprobs: list[dict[int, float] | None] = [None] * len(tokens)
        if self.logprob_rows:
            # NOTE: one read for all three: the ids ride as float64 (exact far beyond any vocabulary size).
            flat = floats_of(logprob_bits) if logprob_bits is not None else self._packed_logprobs().view(-1).tolist()
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
    scores = logits.to(torch.float32, copy=not in_place)
    if token_bitmask is not None:
        processing.apply_token_bitmask(scores, token_bitmask)
    raw_rows = [
        i for i, (n, p) in enumerate(zip(batch.num_logprobs, batch.processed_logprobs)) if n is not None and not p
    ]
    raw = None
    if raw_rows:  # only the rows that ask, before the penalties change them
        raw = scores.clone() if len(raw_rows) == len(batch) else scores[_index(raw_rows, scores.device)]
    processing.apply_stop_mask(scores, batch.stop_rows, batch.stop_tokens)
    if batch.penalty_rows is not None:
        processing.apply_penalties(
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
    errors = processing.settle_infinities(scores)
    # A failed row is dropped by its caller; zeros keep the batched ops below free of NaN. On the CPU the check is
    # free and skips a pass; on a device it would wait for the forward pass, so the fill is unconditional there.
    if waits_for_device(scores.device) or bool(errors.any()):
        scores.masked_fill_((errors != 0)[:, None], 0.0)
    return scores, raw, errors


def sampled_rows(batch: SamplingBatch, device) -> torch.Tensor:
    """(S,) int64 indices of the batch's sampled (not greedy) rows, built on the host (no device sync)."""
    return _index([i for i, greedy in enumerate(batch.greedy_rows) if not greedy], device)


def _index(rows: list[int], device) -> torch.Tensor:
    return to_device(rows, torch.int64, device)


def sampled_probs(
    scores: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor | None = None, filtered: bool = True
) -> torch.Tensor:
    """softmax(scores / temperature) of ``rows`` (all when None), filtered when ``filtered`` (``filtered_probs``)."""
    temperature = batch.temperature if rows is None else batch.temperature[rows]
    # NOTE: the row's maximum comes off before the temperature divides: scores / temperature can overflow float32
    # (penalised scores near 1e38, or a temperature near 1e-5), and softmax of an inf row is NaN. The shifted scores
    # are <= 0, so the quotient is at worst -inf, and the distribution is the same (softmax is shift-invariant).
    top = scores.amax(dim=1, keepdim=True)
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

    Args:
        logits: (R, V) logits of any float dtype on the device; R == len(batch).
        batch: the rows' settings (``build_batch``).
        token_bitmask, in_place: see ``process``.

    Returns:
        The device-side results (``SamplerOutput.to_host`` reads them). A row with NaN logits, or with every token
        ruled out, gets an error code; the other rows are unaffected.
    """
    scores, raw, errors = process(logits, batch, token_bitmask, in_place)
    all_sampled = not any(batch.greedy_rows)
    tokens = None if all_sampled else scores.argmax(dim=1)
    if batch.any_sampled:
        rows = None if all_sampled else sampled_rows(batch, scores.device)
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        probs = sampled_probs(scores if rows is None else scores[rows], batch, rows, filtered=False)
        seeds, positions = pick(batch.seeds), pick(batch.positions)
        if batch.any_filtered:
            top_k, top_p, min_p = pick(batch.top_k), pick(batch.top_p), pick(batch.min_p)
            # NOTE: on a device the rejection rounds would each wait for the forward pass: one sort instead.
            draw = draw_sorted if waits_for_device(scores.device) else draw_filtered
            drawn = draw(probs, top_k, top_p, min_p, seeds, positions, batch.filter_hints)
        else:
            drawn = inverse_cdf(probs, random_stream.uniform(seeds, positions, random_stream.PLAIN))
        if rows is None:
            tokens = drawn
        else:
            tokens[rows] = drawn
    processing.check_tokens(tokens, errors, scores.shape[1])
    return with_logprobs(SamplerOutput(tokens, errors, [], []), scores, raw, batch)


def with_logprobs(
    out: SamplerOutput, scores: torch.Tensor, raw: torch.Tensor | None, batch: SamplingBatch
) -> SamplerOutput:
    """Fill the log-probabilities asked for: one ``log_softmax`` per kind of row, then one ``topk``.

    Args:
        out: the chosen tokens and error codes.
        scores, raw: ``process``'s.
        batch: the rows' settings.
    """
    rows = [i for i, n in enumerate(batch.num_logprobs) if n is not None]
    if not rows:
        return out
    greedy = batch.greedy_rows
    kinds = ["raw" if not batch.processed_logprobs[i] else "greedy" if greedy[i] else "sampled" for i in rows]
    parts = []
    for kind in ("raw", "greedy", "sampled"):
        js = [j for j, k in enumerate(kinds) if k == kind]
        if not js:
            continue
        if kind == "raw":
            processing.settle_infinities(raw)
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
    num = [batch.num_logprobs[i] for i in rows]
    top = torch.topk(logprobs, min(max(num), logprobs.shape[1]), dim=1)
    chosen = logprobs.gather(1, out.tokens[_index(rows, scores.device)][:, None])[:, 0]
    return SamplerOutput(out.tokens, out.errors, rows, num, chosen, top.values, top.indices)
