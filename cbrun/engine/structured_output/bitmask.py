"""A step's token bitmask: one int32 row of ceil(vocab / 32) words per logit row, filled from the requests'
grammar matchers; the batched sampler applies it to every row first (``cbrun.engine.sample.sampler.process``)."""

from __future__ import annotations

import torch

from cbrun.engine.core.plan import SchedulerOutput
from cbrun.engine.sample.sampler import apply_token_bitmask
from cbrun.engine.structured_output.request_state import StructuredOutputRequest, fill_bitmasks
from cbrun.engine.worker.device import to_device
from cbrun.kernels import cpu_token_mask

#: Bits per bitmask word (xgrammar's layout: bit ``t % 32`` of word ``t // 32`` allows token t).
WORD_BITS = 32


class StepBitmask:
    """The bitmask rows of one step, and the requests whose grammar allowed no token.

    Attributes:
        bitmask: (num_logit_rows, ceil(vocab / 32)) int32 CPU; -1 (every token allowed) in unconstrained rows.
        rows: the logit rows that are constrained (a verify step's rows first, then the decoding ones).
        blocked: ``Request.index`` of requests whose grammar allows no token at a row of theirs.
        on_device: ``bitmask`` on the logits' device once uploaded (``StepSampler.fill_grammar_bitmask``).

    ``pin_memory``: page-locked host memory (on a CUDA machine), so the upload does not wait for the device.
    """

    def __init__(self, num_rows: int, vocab_size: int, pin_memory: bool = False) -> None:
        shape = (num_rows, -(-vocab_size // WORD_BITS))
        self.bitmask = torch.full(shape, -1, dtype=torch.int32, pin_memory=pin_memory)
        self.rows: list[int] = []
        self.blocked: set[int] = set()
        self.on_device: torch.Tensor | None = None


def build_step_bitmask(plan: SchedulerOutput, vocab_size: int, pin_memory: bool = False) -> StepBitmask | None:
    """The bitmask of a step's logit rows (None when no planned request is constrained).

    Rows follow the plan's layout (``SchedulerOutput.layout``): per entry, its prompt log-probability rows, then its
    sample rows (one, or one per verified position of a verify step). A verify step gets a mask per position: the
    matcher accepts each proposal after its row is filled, and is rolled back once all are (the committed tokens
    are accepted later, by the scheduler). A proposal the grammar refuses ends the walk: its own row already
    excludes it, so verification rejects it there and never reads the rows after.

    Args:
        plan: the step's plan; each constrained entry's grammar state is in its ``plan.sampling`` values.
        vocab_size: the logits' width.
        pin_memory: see ``StepBitmask``.
    """
    step: StepBitmask | None = None
    decoding: list[tuple[StructuredOutputRequest, int, int]] = []  # (state, row, Request.index), filled at once
    layout = plan.layout
    for item, row in zip(plan.scheduled, layout.first_sample_rows):
        values = plan.sampling.get(item.request_index) if item.samples else None
        state = values.structured if values is not None else None
        if state is not None and state.ready() and state.error is None:
            if step is None:
                step = StepBitmask(layout.num_rows, vocab_size, pin_memory)
            if item.spec_token_ids:
                _fill_entry(step, state, row, item.spec_token_ids, item.request_index)
            else:
                decoding.append((state, row, item.request_index))
    if decoding:
        rows = [row for _, row, _ in decoding]
        allowed = fill_bitmasks([state for state, _, _ in decoding], step.bitmask, rows)
        step.rows.extend(rows)
        step.blocked.update(index for (_, _, index), ok in zip(decoding, allowed) if not ok)
    return step


def _fill_entry(step: StepBitmask, state, row: int, proposals: tuple[int, ...], request_index: int) -> None:
    accepted = 0
    for i in range(len(proposals) + 1):
        step.rows.append(row + i)
        if not state.fill_bitmask(step.bitmask, row + i):
            step.blocked.add(request_index)
        if i == len(proposals) or not state.accept(proposals[i]):
            break
        accepted += 1
        if state.is_terminated:  # an accepted EOS ends the request there: no row after it is read
            break
    state.rollback(accepted)


def masked_argmax(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> list[int | None]:
    """The argmax of each row's logits with its disallowed tokens at -inf, in one batched op on the logits' device.

    On the CPU (float32) the C kernel ``cbrun.kernels.cpu_token_mask`` reads the packed words and the allowed logits
    once, writing nothing; elsewhere the mask is applied (``apply_token_bitmask``) and the rows' maximum taken.
    Both give the first index of the largest allowed logit.

    Args:
        logits: (N, V) the step's logits; on a GPU masked in place when ``rows`` are all of them, in order.
        rows: the rows to read.
        bitmask: (N, ceil(V / 32)) int32 over the step's logit rows, on the logits' device.

    Returns:
        Per row its token, or None where the masked logits hold NaN or allow nothing (the sampler then gives the
        row's error).
    """
    if cpu_token_mask.supports(logits, bitmask):
        return [t if t >= 0 else None for t in cpu_token_mask.masked_argmax_cpu(logits, rows, bitmask)]
    if rows == list(range(logits.shape[0])):  # every row of the step: masked in place, no copy (the mask is
        scores = apply_token_bitmask(logits, bitmask)  # applied first anyway, and again is the same)
    else:
        index = to_device(rows, torch.int64, logits.device)
        scores = apply_token_bitmask(logits[index], bitmask[index])
    best, tokens = scores.max(dim=1)  # a row with a NaN has a NaN maximum
    tokens = tokens.masked_fill(best.isnan() | (best == float("-inf")), -1)  # one read back from the device
    return [t if t >= 0 else None for t in tokens.tolist()]
