"""A step's logits to its ``StepOutput``: every sampled row, verified position and prompt row in a few batched calls,
read back once.

``StepSampler`` is the worker side's read of a step (vLLM v1's sampler plus the half of ``execute_model`` that
builds ``ModelRunnerOutput``). It takes the plan, whose ``RowLayout`` says where each entry's rows are and whose
``RowSampling`` values say how to sample them, and returns one ``StepOutput``: per request index the tokens to
commit, their log-probabilities, prompt log-probabilities, or the error its row failed with. It never reads or
writes a ``Request`` and calls nothing back: the scheduler's ``update_from_output`` applies the value.

Everything is chosen when the step is launched (``launch``, called by the model runner right after the forward
pass): the plan's entries are sorted once into the kinds of row (``StepRows``), rows that sample are drawn by the
sampler (``cbrun.engine.sample.sampler``), constrained ones with the grammar bitmask the engine filled before the
launch, verify entries are verified, and prompt rows scored. Their tokens stay on the device for the next step
(async batching) and come back in the step's one read-back (``StepHandle``), each failed row's error code folded
in; log-probabilities, prompt scores and the verify entries' decisions ride in the same copy as float64 bit
patterns (``float_bits``). ``read`` waits for that copy and unpacks it. Should a batched call raise an exception of
the request's own kind (``cbrun.engine.core.faults.is_request_fault``), its rows are redone one at a time, so only
the rows that raise alone fail: a row's result does not depend on its batch.

Batch invariance on a device (``rows_alone``, set under ``engine.batch_invariant`` off the CPU): the sampled rows
are drawn one at a time, each a (1, V) call. torch's CUDA scans and reductions (the inverse CDF's ``cumsum``, the
filters' sums) choose their thread layout by the number of rows as well as the row length (PyTorch's inner scan
picks its threads per row from both), so a row drawn among others could sum its probabilities in another order
than alone; one row per call gives every row the same shapes, hence the same kernels, whatever its batch. On the
CPU the batched ops are row-wise already (``tests/engine/test_batch_invariance.py``) and rows stay batched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import cast

import numpy as np
import torch

from cbrun.engine.core.faults import SamplingError, is_request_fault, request_error_message
from cbrun.engine.core.plan import RowSampling, ScheduledRequest, SchedulerOutput, StepOutput
from cbrun.engine.sample.sampler import (
    SamplerOutput,
    SamplingRow,
    SamplingSlots,
    TokenCounts,
    build_batch,
    float_bits,
    floats_of,
    sample,
)
from cbrun.engine.spec_decode.speculative import accept_greedy
from cbrun.engine.spec_decode.speculative_rule import verify
from cbrun.engine.structured_output.bitmask import StepBitmask, build_step_bitmask, masked_argmax
from cbrun.engine.worker.device import to_device, waits_for_device

#: Bytes of float32 scratch one chunk of prompt log-probability rows may use (its copy and its log-softmax): a
#: scoring step's rows are scored this many at a time, so the scratch never grows with the step's rows.
PROMPT_LOGPROB_CHUNK_BYTES = 64 * 2**20

BLOCKED_MESSAGE = (
    "structured outputs: the constraint allows no token here (the tokenizer cannot express its next character)"
)


@dataclass
class StepHandle:
    """A launched step whose results may still be on the device, and its one read-back on its way to the host.

    Attributes:
        logits: (N, vocab_size) logits in plan order (prompt log-probability rows, then the sample rows, per entry);
            a private copy when the step was launched behind another, so the next replay cannot overwrite it.
        sampled: (S,) int64 on the device, each sample row's token in plan order (a failed row's 0): what the next
            step reads for a request whose input is still pending (async batching).
        sample_row_of: ``Request.index -> row`` of ``sampled`` (its first: ``RowLayout.sample_index_of``).
        launched: the step's rows as ``StepSampler.launch`` sorted and drew them (``StepRows``), or None (a plain
            greedy plan, or a runner that samples nothing).
        done: CUDA event recorded after the device-to-host copy of the read-back (None on the CPU).
    """

    logits: torch.Tensor
    sampled: torch.Tensor
    sample_row_of: dict[int, int]
    _sampled_host: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    launched: StepRows | None = None
    num_tokens: int | None = None
    _token_ids: list[int] | None = field(default=None, repr=False)
    _extra_ids: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def launch_readback(
        cls,
        logits: torch.Tensor,
        sampled: torch.Tensor,
        sample_row_of: dict[int, int],
        readback: torch.Tensor | None = None,
        launched: StepRows | None = None,
        extras: list[torch.Tensor] | None = None,
    ) -> StepHandle:
        """Start copying ``readback`` (``sampled`` when None) and ``extras`` to the host in one copy, without
        waiting (pinned buffer + event on CUDA).

        Args:
            readback: ``sampled`` with each failed row's id negative, its error code
                (``cbrun.engine.sample.sampler.encode_errors``); ``sampled`` is what the next step reads.
            extras: further (n,) int64 device values the step's reader needs (log-probabilities as float64 bit
                patterns, ``float_bits``), appended to the same copy, so the step still waits once.
        """
        readback = sampled if readback is None else readback
        num_tokens = readback.shape[0]
        if extras:
            readback = torch.cat([readback, *extras])
        if sampled.device.type != "cuda":
            return cls(logits, sampled, sample_row_of, readback, launched=launched, num_tokens=num_tokens)
        host = torch.empty(readback.shape, dtype=readback.dtype, pin_memory=True)
        host.copy_(readback, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(logits, sampled, sample_row_of, host, done, launched=launched, num_tokens=num_tokens)

    def token_ids(self) -> list[int]:
        """The read-back ids in plan order (a row failed by the sampler negative); waits for the step (and its
        copy) to finish. This is the step's one read: the extras come with it (``extra_ids``)."""
        if self._token_ids is None:
            if self.done is not None:
                self.done.synchronize()
            assert self._sampled_host is not None  # ``launch_readback`` always sets it
            values = self._sampled_host.tolist()
            n = len(values) if self.num_tokens is None else self.num_tokens
            self._token_ids, self._extra_ids = values[:n], values[n:]
        return self._token_ids

    def extra_ids(self) -> list[int]:
        """The ``extras`` of ``launch_readback``, concatenated, as host int64 values (read with the tokens)."""
        self.token_ids()
        return self._extra_ids


@dataclass
class VerifyEntry:
    """A sampled or host-processed request's verify entry: its logit rows start at ``first_row`` (one per
    proposal, then the bonus row); ``draft_probs`` is the draft's (proposals, V) q, None for n-gram proposals."""

    values: RowSampling
    proposals: list[int]
    first_row: int
    draft_probs: torch.Tensor | None


@dataclass
class StepRows:
    """A plan's entries sorted once, at launch, into the kinds of row the step handles, with what each produced.

    Attributes:
        rows, items, logit_rows, sample_rows: the entries the sampler draws one token for (sampled, penalised, with
            log-probabilities, constrained): their requests' ``RowSampling`` as sent (``RowSampling.at`` of the
            entry gives the step's), their plan entries, their logit rows and their rows of the read-back.
            ``every_row``: they are all the step's logit rows and all its sample rows, in order (no gather needed).
        slots, indices: the drawn rows' ``SamplingSlots`` slots and ``Request.index`` when the step was sorted by
            the common path (every entry one drawn row), else None (looked up when needed).
        argmax: (``Request.index``, sample row) of plain greedy entries in a plan that is not plain greedy: their
            token is the device's argmax.
        accept_greedy: (``Request.index``, first sample row, proposals) of greedy verify entries (their tokens are
            the argmax rows, checked on the host).
        masked: (values, entry, logit row, sample row, token) of greedy constrained rows whose token the CPU's
            masked argmax chose at launch (``masked_argmax``).
        prompt_rows: (values, first logit row, prompt positions) of each entry scoring its prompt.
        verify: the verify entries verified by the rule (``verify``), at launch.
        output: the sampled rows' device results, None when the batched call raised and the rows were redone alone
            (``results`` then holds each row's (error message or None, log-probabilities or None)).
        verified: the verify entries' device results, None when verifying them together raised (they are then
            verified when the step is read, alone where needed).
        num_logprob_bits, num_prompt_bits, num_verify_ids, num_verify_logprob_bits: how many of the read-back's
            extra values are, in that order, the rows' log-probabilities, the prompt scores, the verify entries'
            tokens and their log-probabilities.
    """

    rows: list[RowSampling] = field(default_factory=list)
    items: list[ScheduledRequest] = field(default_factory=list)
    slots: list[int] | None = None
    indices: list[int] | None = None
    logit_rows: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    every_row: bool = False
    argmax: list[tuple[int, int]] = field(default_factory=list)
    accept_greedy: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    masked: list[tuple[RowSampling, ScheduledRequest, int, int, int]] = field(default_factory=list)
    prompt_rows: list[tuple[RowSampling, int, range]] = field(default_factory=list)
    verify: list[VerifyEntry] = field(default_factory=list)
    output: SamplerOutput | None = None
    results: list[tuple[str | None, dict[int, float] | None]] | None = None
    verified: SamplerOutput | None = None
    num_logprob_bits: int = 0
    num_prompt_bits: int = 0
    num_verify_ids: int = 0
    num_verify_logprob_bits: int = 0


class StepSampler:
    """Owns each sampled request's settings (``SamplingSlots``) and the penalised requests' token counts
    (``TokenCounts``), and turns a step's logits into its ``StepOutput``.

    Every call runs in inference mode, at launch (inside the model runner's) or when a step is read, so the
    counts are always inference tensors updated in inference mode.

    Args:
        vocab_size: V.
        device: the logits' device.
        eos_token_ids: the model's EOS ids.
        rows_alone: sample each row in its own call (batch invariance on a device; see the module docstring).
    """

    def __init__(
        self, vocab_size: int, device: torch.device | str, eos_token_ids: frozenset[int], rows_alone: bool = False
    ) -> None:
        #: Each running request's ``RowSampling`` by ``Request.index``, as its first plan sent it
        #: (``SchedulerOutput.new_sampling``, ``add_requests``), until it finishes (``release``).
        self.values: dict[int, RowSampling] = {}
        self.token_counts = TokenCounts(vocab_size, device)
        #: Each sampled request's settings, written once (``SamplingSlots``).
        self.slots = SamplingSlots()
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = eos_token_ids
        self.rows_alone = rows_alone
        #: The last common step's drawn rows (``_common_rows``): the next decode step usually has the same.
        self._common: _CommonRows | None = None

    def add_requests(self, new_sampling: dict[int, RowSampling]) -> None:
        """Keep the values of the requests a plan sends for the first time (``SchedulerOutput.new_sampling``);
        called for every plan, before anything reads it."""
        if new_sampling:
            self.values.update(new_sampling)

    def release(self, request_index: int) -> None:
        """Forget a finished request's values, counts and settings."""
        self.values.pop(request_index, None)
        self._common = None
        self.token_counts.release(request_index)
        self.slots.release(request_index)

    def release_all(self) -> None:
        self.values.clear()
        self._common = None
        self.token_counts.release_all()
        self.slots.release_all()

    def fill_grammar_bitmask(self, plan: SchedulerOutput) -> StepBitmask | None:
        """The step's token bitmask, uploaded to the logits' device: (N logit rows, ceil(V / 32)) int32, every token
        allowed in unconstrained rows; None when no planned request is constrained.

        Called before the step is launched (the sampler applies it at launch, so constrained rows ride in the
        step's one read-back like the others). A constrained request never runs with a token still pending, so its
        matcher is already past its previous token; with async batching the host fills the masks while the device
        computes the step before, and the upload is from pinned memory (it does not wait).
        """
        if plan.plain_greedy:  # a constrained request is never a plain greedy entry
            return None
        step = build_step_bitmask(plan, self.values, self.vocab_size, self.device.type == "cuda")
        if step is not None:
            step.on_device = step.bitmask.to(self.device, non_blocking=True)
        return step

    # ---- at launch ------------------------------------------------------------------------------------------
    def rows_of(
        self, plan: SchedulerOutput, draft_probs: dict[int, torch.Tensor] | None = None, on_cpu: bool = True
    ) -> StepRows | None:
        """The plan's entries sorted into the kinds of row (``StepRows``; ``draft_probs``: the draft distributions
        of sampled verify entries, by ``Request.index``; ``on_cpu``: greedy constrained rows go to the CPU's
        masked argmax, else to the sampler); None for a plain greedy plan, whose tokens are the argmax."""
        if plan.plain_greedy:
            return None
        layout, sampling, scheduled = plan.layout, self.values, plan.scheduled
        step = StepRows()
        if layout.num_rows == len(layout.sample_index_of) == len(scheduled):
            # NOTE: each entry one sample row, no prompt rows or proposals: when every one is drawn (e.g. every row
            # at Llama-3's defaults) the step needs no per-entry loop
            common = self._common_rows(scheduled, on_cpu)
            if common is not None:
                step.rows, step.items, step.slots, step.indices = common.rows, scheduled, common.slots, common.indices
                step.logit_rows = step.sample_rows = common.every
                step.every_row = True
                return step
        masked_greedy: list[tuple[RowSampling, ScheduledRequest, int, int]] = []
        for item, first_row, first_sample_row, first_sample in zip(
            scheduled, layout.first_rows, layout.first_sample_rows, layout.first_samples
        ):
            if item.prompt_logprob_positions:
                step.prompt_rows.append((sampling[item.request_index], first_row, item.prompt_logprob_positions))
            if not item.samples:
                continue
            if not item.needs_host_sampling:  # greedy: the device's argmax
                if item.spec_token_ids:
                    step.accept_greedy.append((item.request_index, first_sample, item.spec_token_ids))
                else:
                    step.argmax.append((item.request_index, first_sample))
                continue
            values = sampling[item.request_index]
            if item.spec_token_ids:
                probs = draft_probs.get(item.request_index) if draft_probs else None
                step.verify.append(VerifyEntry(values.at(item), list(item.spec_token_ids), first_sample_row, probs))
            elif on_cpu and values.structured is not None and self.slots.flag(values, "masked_greedy"):
                masked_greedy.append((values, item, first_sample_row, first_sample))
            else:
                step.rows.append(values)
                step.items.append(item)
                step.logit_rows.append(first_sample_row)
                step.sample_rows.append(first_sample)
        step.masked = [(v, item, row, at, -1) for v, item, row, at in masked_greedy]
        n = len(step.rows)
        step.every_row = n == layout.num_rows == layout.num_sample_rows
        return step

    def _common_rows(self, scheduled: list[ScheduledRequest], on_cpu: bool) -> _CommonRows | None:
        """The rows of a step whose entries (one sample row each) are all drawn by the sampler, or None when one
        is not (a greedy row, or a constrained greedy one for the CPU's masked argmax). Kept for the next step:
        while the step's requests are the same, in the same order (the decode steps of a full batch), their
        values, slots and predicates are too."""
        indices = list(map(_REQUEST_INDEX, scheduled))
        kept = self._common
        if kept is not None and kept.on_cpu == on_cpu and kept.indices == indices:
            return kept
        if not all(map(_HOST_SAMPLED, scheduled)):
            return None
        rows = list(map(self.values.__getitem__, indices))
        slots = self.slots.slots(rows)
        if on_cpu and self.slots.any_flag(rows, "masked_greedy"):
            return None
        self._common = _CommonRows(indices, rows, slots, list(range(len(rows))), on_cpu)
        return self._common

    @torch.inference_mode()
    def launch(
        self,
        plan: SchedulerOutput,
        logits: torch.Tensor,
        argmax: torch.Tensor,
        previous: StepHandle | None = None,
        grammar: StepBitmask | None = None,
        draft_probs: dict[int, torch.Tensor] | None = None,
    ) -> StepHandle:
        """Draw, verify and score every row of the launched step on the device, and start its one read-back.

        Args:
            plan: the step's plan.
            logits: (N, V) the step's logits.
            argmax: (S,) int64, the step's argmax of its sample rows (zeros when no entry reads it).
            previous: the step in flight (async batching): a penalised row's pending token is counted from its
                tokens on the device (``TokenCounts.count_pending``).
            grammar: the step's token bitmask (``fill_grammar_bitmask``), or None.
            draft_probs: the draft distributions of the plan's sampled verify entries, by ``Request.index``.

        Returns:
            The step's handle: its read-back is ``argmax`` with the drawn rows' tokens in place and each failed
            row's id negative (its error code, ``encode_errors``), followed by the extras (log-probabilities, prompt
            scores, verify results); its ``sampled`` the same tokens with failed rows' ids 0 (valid embedding
            indices for the next step; the host drops those rows).
        """
        layout = plan.layout
        step = self.rows_of(plan, draft_probs, on_cpu=not waits_for_device(logits.device))
        if step is None:
            return StepHandle.launch_readback(logits, argmax, layout.sample_index_of)
        bitmask = grammar.on_device if grammar is not None else None
        readback, extras = argmax, []
        if step.masked:
            readback = self._masked_argmax(logits, bitmask, step, readback)
        if step.rows:
            readback = self._draw(logits, readback, step, previous, bitmask)
            bits = step.output.logprob_bits() if step.output is not None else None
            if bits is not None:
                extras.append(bits)
                step.num_logprob_bits = bits.shape[0]
        if step.prompt_rows:
            extras.append(self._score_prompts(step.prompt_rows, logits))
            step.num_prompt_bits = extras[-1].shape[0]
        if step.verify:
            extras += self._launch_verify(logits, step, bitmask)
        sampled = readback.clamp(min=0) if step.rows else readback  # a failed row's token: a valid index
        return StepHandle.launch_readback(logits, sampled, layout.sample_index_of, readback, step, extras)

    def _launch_verify(self, logits: torch.Tensor, step: StepRows, bitmask: torch.Tensor | None) -> list[torch.Tensor]:
        """The step's verify entries checked on the device (``step.verified``): the read-back extras of their
        results (accepted ids, then log-probability bits where asked), their sizes noted on ``step``. No extras when
        a request's fault stops the check (``step.verified`` stays None: ``read`` verifies the entries then)."""
        try:
            step.verified, read = self._verify_on_device(logits, step.verify, bitmask)
        except Exception as error:
            if not is_request_fault(error):
                raise
            return []
        extras = [read]
        step.num_verify_ids = read.shape[0]
        bits = step.verified.logprob_bits()
        if bits is not None:
            extras.append(bits)
            step.num_verify_logprob_bits = bits.shape[0]
        return extras

    def _masked_argmax(
        self, logits: torch.Tensor, bitmask: torch.Tensor | None, step: StepRows, readback: torch.Tensor
    ) -> torch.Tensor:
        """Greedy constrained rows on the CPU: the masked argmax (one C call) into ``readback``; a row whose masked
        logits hold NaN or allow nothing goes to the sampler, so its error is the sampler's."""
        assert bitmask is not None  # a constrained row comes with the step's bitmask
        tokens = masked_argmax(logits, [row for _, _, row, _, _ in step.masked], bitmask)
        kept = []
        for (values, item, row, at, _), token in zip(step.masked, tokens):
            if token is None:
                step.rows.append(values)
                step.items.append(item)
                step.logit_rows.append(row)
                step.sample_rows.append(at)
            else:
                kept.append((values, item, row, at, token))
        step.masked = kept
        if kept:
            readback = readback.clone()
            readback[to_device([at for _, _, _, at, _ in kept], torch.int64, readback.device)] = to_device(
                [t for _, _, _, _, t in kept], torch.int64, readback.device
            )
        return readback

    def _draw(
        self,
        logits: torch.Tensor,
        readback: torch.Tensor,
        step: StepRows,
        previous: StepHandle | None,
        bitmask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The read-back with the drawn rows' tokens (failed rows' error codes) in place."""
        rows, items = self._step_values(step.rows, step.items, step.slots), step.items
        if previous is not None:  # a penalised row whose last token is still on the device counts it from there
            pending = [rows[i] for i in self.slots.penalised(rows, step.slots) if items[i].num_pending_inputs]
            if pending:
                rows_in_flight = [previous.sample_row_of[r.request_index] for r in pending]
                self.token_counts.count_pending(pending, previous.sampled, rows_in_flight)
        every = step.every_row
        mask = None
        if bitmask is not None and any(r.structured is not None for r in rows):
            mask = bitmask if every else bitmask[to_device(step.logit_rows, torch.int64, bitmask.device)]
        if self.rows_alone and len(rows) > 1:  # batch invariance on a device: every row in its own call
            tokens = self._draw_alone(logits, rows, items, step, bitmask)
        else:
            try:
                batch = self.slots.batch(
                    rows, None, self.token_counts, self.eos_token_ids, logits.device, _ends(items), step.slots
                )
                # NOTE: every row of the step: processed in a copy (the logits stay as launched); else the gather
                # copies
                rows_logits = logits if every else logits[to_device(step.logit_rows, torch.int64, logits.device)]
                step.output = sample(rows_logits, batch, mask, in_place=not every)
                tokens = step.output.readback()
            except Exception as error:
                if not is_request_fault(error):
                    raise
                tokens = self._draw_alone(logits, rows, items, step, bitmask)
        if every:
            return tokens
        readback = readback.clone()
        readback[to_device(step.sample_rows, torch.int64, readback.device)] = tokens
        return readback

    def _draw_alone(
        self,
        logits: torch.Tensor,
        rows: list[RowSampling],
        items: list[ScheduledRequest],
        step: StepRows,
        bitmask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The step's rows (``rows``: their values at this step, ``items``: their entries) drawn one call each (after
        a request fault, or under ``rows_alone``), read back now: their tokens (0 for a failed row, whose error is in
        ``step.results``) on the logits' device."""
        results = self._isolated(lambda at: self._sample(logits, rows, items, step.logit_rows, at, bitmask), len(rows))
        step.results = [_launched_result(r) for r in results]
        ids = [r[0] if not isinstance(r, Exception) else 0 for r in results]
        return to_device(ids, torch.int64, logits.device)

    # ---- when the step is read ------------------------------------------------------------------------------
    @torch.inference_mode()
    def read(
        self,
        plan: SchedulerOutput,
        handle: StepHandle,
        grammar: StepBitmask | None = None,
        draft_probs: dict[int, torch.Tensor] | None = None,
    ) -> StepOutput:
        """The step's ``StepOutput``: waits for its one read-back and unpacks it.

        Args:
            plan: the launched plan.
            handle: its handle (``launch``).
            grammar: its token bitmask (``fill_grammar_bitmask``), or None.
            draft_probs: this step's draft distributions of sampled verify entries, by ``Request.index`` (for the
                entries verified again now, when verifying them together at launch raised).
        """
        token_ids = handle.token_ids()  # each sample row's token (argmax or sampled), in plan order
        out = StepOutput()
        step = handle.launched
        if step is None:  # a plain greedy plan: the argmax of each sampling entry
            sampled = out.token_ids
            for item, at in zip(plan.scheduled, plan.layout.first_samples):
                if item.samples:
                    sampled[item.request_index] = [token_ids[at]]
            return out
        if grammar is not None:
            for index in grammar.blocked:
                out.fail(index, BLOCKED_MESSAGE)
        for index, at in step.argmax:
            out.token_ids[index] = [token_ids[at]]
        for index, at, proposals in step.accept_greedy:
            out.token_ids[index] = accept_greedy(proposals, token_ids[at : at + len(proposals) + 1])
        for values, _, _, _, token in step.masked:
            _put(out, values, None, [token], None)
        extra = handle.extra_ids()  # read with the tokens
        if step.rows:
            self._read_drawn(step, token_ids, extra[: step.num_logprob_bits], out)
        if step.prompt_rows:
            scores = floats_of(extra[step.num_logprob_bits :][: step.num_prompt_bits])
            self._put_prompt_logprobs(step.prompt_rows, scores, out)
        if step.verified is not None:
            self._read_verified(step, extra[step.num_logprob_bits + step.num_prompt_bits :], out)
        elif step.verify:  # verifying them together raised at launch: each alone where needed, now
            bitmask = grammar.on_device if grammar is not None else None
            self._verify_entries(handle.logits, step.verify, bitmask, out)
        return out

    def _read_drawn(self, step: StepRows, token_ids: list[int], logprob_bits: list[int], out: StepOutput) -> None:
        """Rows drawn at launch: their read-back tokens, errors and log-probabilities (``logprob_bits``, read back
        with them) into ``out``."""
        tokens = token_ids if step.every_row else [token_ids[i] for i in step.sample_rows]
        if step.results is None and not logprob_bits and (not tokens or min(tokens) >= 0):
            # NOTE: the common step (no row failed, no log-probabilities): one dict update, no per-row call
            failed = out.errors
            if failed:
                out.token_ids.update(
                    (v.request_index, [t]) for v, t in zip(step.rows, tokens) if v.request_index not in failed
                )
            else:
                indices = step.indices if step.indices is not None else map(_REQUEST_INDEX, step.rows)
                out.token_ids.update(zip(indices, [[t] for t in tokens]))
            return
        if step.results is None:
            assert step.output is not None  # drawn together: their device results
            _, errors, row_logprobs = step.output.to_host(tokens, logprob_bits)
            step.results = [_launched_result((None, error, lp)) for error, lp in zip(errors, row_logprobs)]
        for values, token, (message, logprobs) in zip(step.rows, tokens, step.results):
            _put(out, values, message, [token], None if logprobs is None else [logprobs])

    def _read_verified(self, step: StepRows, extra: list[int], out: StepOutput) -> None:
        """The entries verified at launch: their committed tokens and log-probabilities from ``extra`` (the
        read-back's values after the prompt log-probabilities) into ``out``."""
        assert step.verified is not None  # verified at launch
        read = extra[: step.num_verify_ids]
        bits = extra[step.num_verify_ids :][: step.num_verify_logprob_bits]
        results = self._verify_results(step.verify, step.verified, read, bits)
        self._put_verified(step.verify, results, out)

    def _verify_entries(
        self, logits: torch.Tensor, entries: list[VerifyEntry], bitmask: torch.Tensor | None, out: StepOutput
    ) -> None:
        """The tokens each verify entry commits: its accepted proposals, then a replacement or the bonus token."""
        results = self._isolated(lambda at: self._verify(logits, [entries[i] for i in at], bitmask), len(entries))
        self._put_verified(entries, results, out)

    @staticmethod
    def _put_verified(entries: list[VerifyEntry], results: list, out: StepOutput) -> None:
        """Each verify entry's result (``_verify_results``' triple or its exception) into ``out``."""
        for entry, result in zip(entries, results):
            if isinstance(result, Exception):
                out.fail(entry.values.request_index, request_error_message("sampling", result))
                continue
            tokens, error, logprobs = result
            message = request_error_message("sampling", SamplingError(error)) if error is not None else None
            _put(out, entry.values, message, tokens, logprobs if entry.values.params.logprobs is not None else None)

    def _score_prompts(self, entries: list[tuple[RowSampling, int, range]], logits: torch.Tensor) -> torch.Tensor:
        """Log-probability of each next prompt token, and whether it was the argmax, for every entry of the step,
        packed for the step's read-back (``float_bits`` of (2, rows) float64: the scores, then the flags).

        The rows are scored a chunk at a time (``PROMPT_LOGPROB_CHUNK_BYTES`` of float32 scratch): per chunk one
        copy to float32, one ``log_softmax``, a gather and an argmax, so only (rows,) results are kept, never a
        second (rows, V) tensor.

        Args:
            entries: (values, its first row in ``logits``, its prompt positions); logits: (N, V).
        """
        rows = [r for _, first, positions in entries for r in range(first, first + len(positions))]
        targets = [
            t
            for values, _, positions in entries
            for t in values.prompt_token_ids[positions.start + 1 : positions.stop + 1]
        ]
        device = logits.device
        row_index = to_device(rows, torch.int64, device)
        target_index = to_device(targets, torch.int64, device)
        chunk = prompt_logprob_chunk_rows(logits.shape[-1])
        scores = torch.empty(len(rows), dtype=torch.float32, device=device)
        greedy = torch.empty(len(rows), dtype=torch.bool, device=device)
        for start in range(0, len(rows), chunk):
            at = slice(start, start + chunk)
            part = logits[row_index[at]].float()
            target = target_index[at, None]
            greedy[at] = part.argmax(dim=-1) == target[:, 0]
            part = torch.log_softmax(part, dim=-1)
            scores[at] = part.gather(1, target)[:, 0]
            del part
        return float_bits(torch.stack((scores, greedy.float())))

    @staticmethod
    def _put_prompt_logprobs(
        entries: list[tuple[RowSampling, int, range]], packed: list[float], out: StepOutput
    ) -> None:
        """``_score_prompts``' values, read back to the host, into ``out.prompt_logprobs`` per entry."""
        num_rows = len(packed) // 2
        scores, greedy = packed[:num_rows], packed[num_rows:]
        start = 0
        for values, _, positions in entries:
            end = start + len(positions)
            out.prompt_logprobs[values.request_index] = (scores[start:end], [g > 0.5 for g in greedy[start:end]])
            start = end

    def _isolated(self, run: Callable[[list[int]], list], num_items: int) -> list:
        """``run`` over all items at once (each alone from the start under ``rows_alone``); on a request fault,
        over each alone: an item that raises alone has its exception as its result (its row fails)."""
        if not (self.rows_alone and num_items > 1):
            try:
                return run(list(range(num_items)))
            except Exception as error:
                if not is_request_fault(error):
                    raise
        results = []
        for i in range(num_items):
            try:
                results.append(run([i])[0])
            except Exception as error:
                if not is_request_fault(error):
                    raise
                results.append(error)
        return results

    def _step_values(
        self, rows: list[RowSampling], items: list[ScheduledRequest], slots: list[int] | None = None
    ) -> list[RowSampling]:
        """``rows`` with each penalised request's values at this step (``RowSampling.at``: its token counts read
        its output and position); the others as sent (their position comes from the entries, ``_ends``).
        ``slots``: the rows' slots when known."""
        penalised = self.slots.penalised(rows, slots)
        if not penalised:
            return rows
        rows = list(rows)
        for i in penalised:
            rows[i] = rows[i].at(items[i])
        return rows

    def _sample(
        self,
        logits,
        values: list[RowSampling],
        items: list[ScheduledRequest],
        rows: list[int],
        at: list[int],
        token_bitmask,
    ):
        """Rows ``at`` of ``values`` (their entries ``items``, logit rows ``rows``) drawn and read back now: each
        (token, error, logprobs). ``token_bitmask``: the step's, by logit row, or None."""
        batch = self.slots.batch(
            [values[i] for i in at],
            None,
            self.token_counts,
            self.eos_token_ids,
            logits.device,
            _ends([items[i] for i in at]),
        )
        index = to_device([rows[i] for i in at], torch.int64, logits.device)
        mask = token_bitmask[index.to(token_bitmask.device)] if token_bitmask is not None else None
        tokens, errors, logprobs = sample(logits[index], batch, mask, in_place=True).to_host()  # the index copied
        return list(zip(tokens, errors, logprobs))

    def _verify(self, logits, entries: list[VerifyEntry], token_bitmask=None):
        """Each entry's (committed tokens, error code or None, their log-probabilities), read back now."""
        sampled, read = self._verify_on_device(logits, entries, token_bitmask)
        return self._verify_results(entries, sampled, read.tolist(), None)

    def _verify_on_device(
        self, logits, entries: list[VerifyEntry], token_bitmask=None
    ) -> tuple[SamplerOutput, torch.Tensor]:
        """Verify the entries on the device: (the verified rows' ``SamplerOutput``, (rows,) int64 read-back of their
        tokens with the accept flags folded in: an accepted row's id + V). Reads nothing back."""
        rows, logit_rows, proposals, drafted = [], [], [], []
        for entry in entries:
            spec = entry.proposals
            for i in range(len(spec) + 1):
                rows.append(SamplingRow(entry.values, spec[:i]))
                logit_rows.append(entry.first_row + i)
                proposals.append(spec[i] if i < len(spec) else -1)
                drafted.append(entry.draft_probs is not None and i < len(spec))
        device = logits.device
        batch = build_batch(rows, self.token_counts, self.eos_token_ids, device, self.slots)
        draft_probs = has_draft = None
        if any(drafted):
            draft_probs = torch.zeros(len(rows), logits.shape[1], dtype=torch.float32, device=device)
            at = [j for j, d in enumerate(drafted) if d]
            draft_probs[to_device(at, torch.int64, device)] = torch.cat(
                [e.draft_probs for e in entries if e.draft_probs is not None]
            ).to(device, torch.float32)
            has_draft = to_device(drafted, torch.bool, device)
        index = to_device(logit_rows, torch.int64, device)
        result = verify(
            logits[index],
            batch,
            to_device(proposals, torch.int64, device),
            draft_probs,
            has_draft,
            token_bitmask[index] if token_bitmask is not None else None,
        )
        # NOTE: one read-back: the accept flags ride with the tokens (an accepted row's id + V).
        readback = result.sampled.readback()
        return result.sampled, torch.where(result.accepted, readback + self.vocab_size, readback)

    def _verify_results(
        self, entries: list[VerifyEntry], sampled: SamplerOutput, read: list[int], logprob_bits: list[int] | None
    ):
        """``_verify_on_device``'s read-back (and log-probabilities, ``SamplerOutput.to_host``) per entry."""
        accepted = [t >= self.vocab_size for t in read]
        read = [t - self.vocab_size if a else t for t, a in zip(read, accepted)]
        tokens, errors, logprobs = sampled.to_host(read, logprob_bits)
        results, j = [], 0
        for entry in entries:
            committed, committed_logprobs, error = [], [], None
            for i in range(len(entry.proposals) + 1):
                error = error or errors[j + i]
                committed.append(tokens[j + i])
                committed_logprobs.append(logprobs[j + i])
                if not accepted[j + i]:
                    break
            results.append((committed, error, committed_logprobs))
            j += len(entry.proposals) + 1
        return results


@dataclass
class _CommonRows:
    """The drawn rows of a step whose entries are all drawn (``StepSampler._common_rows``): the requests'
    ``Request.index``, values and slots, the rows' indices, and whether the step ran on the CPU."""

    indices: list[int]
    rows: list[RowSampling]
    slots: list[int]
    every: list[int]
    on_cpu: bool


_HOST_SAMPLED = attrgetter("needs_host_sampling")
_REQUEST_INDEX = attrgetter("request_index")


def _ends(items: list[ScheduledRequest]) -> np.ndarray:
    """(R,) int64 each drawn entry's context end after its step (no proposals): its output position plus its
    prompt's length (``SamplingSlots.batch``)."""
    return np.fromiter((item.start + item.num_tokens for item in items), np.int64, len(items))


def prompt_logprob_chunk_rows(vocab_size: int) -> int:
    """Prompt log-probability rows scored at once: what ``PROMPT_LOGPROB_CHUNK_BYTES`` holds of float32 rows
    (a copy and its log-softmax), at least one."""
    return max(1, PROMPT_LOGPROB_CHUNK_BYTES // (2 * 4 * vocab_size))


def _put(
    out: StepOutput,
    values: RowSampling,
    error: str | None,
    tokens: list[int],
    logprobs: list[dict[int, float] | None] | None,
) -> None:
    """One request's result into ``out``: its error, or its tokens and (when asked) their log-probabilities."""
    index = values.request_index
    if error is not None:
        out.fail(index, error)
    elif index not in out.errors:
        out.token_ids[index] = tokens
        if logprobs is not None and values.params.logprobs is not None:
            # a row that asks for log-probabilities has them for each of its tokens
            out.logprobs[index] = cast("list[dict[int, float]]", logprobs)


def _launched_result(result) -> tuple[str | None, dict[int, float] | None]:
    """(error message, log-probabilities) of a row: its ``_sample`` triple or its exception."""
    if isinstance(result, Exception):
        return request_error_message("sampling", result), None
    _, error, logprobs = result
    return (request_error_message("sampling", SamplingError(error)) if error is not None else None), logprobs
