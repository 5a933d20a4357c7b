"""A step's logits to its ``StepOutput``: every sampled row, verified position and prompt row in a few batched calls.

``StepSampler`` is the worker side's read of a step (vLLM v1's sampler plus the half of ``execute_model`` that
builds ``ModelRunnerOutput``). It takes the plan, whose ``RowLayout`` says where each entry's rows are and whose
``RowSampling`` values say how to sample them, and returns one ``StepOutput``: per request index the tokens to
commit, their log-probabilities, prompt log-probabilities, or the error its row failed with. It never reads or
writes a ``Request`` and calls nothing back: the scheduler's ``update_from_output`` applies the value.

Rows that sample one token are sampled when the step is launched (``launch_rows`` / ``sample_at_launch``, called
by the model runner), so their tokens stay on the device for the next step (async batching) and come back in the
step's one read-back with each failed row's error code folded in; their log-probabilities and the step's prompt
log-probabilities (scored at launch too) ride in the same copy as float64 bit patterns
(``async_batching.float_bits``), as do the verify entries' decisions (verified at launch). Constrained rows
(their bitmask needs the matcher past the previous token) are sampled when the step is read (``read``), a
further read; so are constrained verify entries. Should a
batched call raise an exception of the request's own kind (``cbrun.engine.core.faults.is_request_fault``), its
rows are redone one at a time, so only the rows that raise alone fail: a row's result does not depend on its batch.

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

import torch

from cbrun.engine.core.faults import SamplingError, is_request_fault, request_error_message
from cbrun.engine.core.plan import RowSampling, SchedulerOutput, StepOutput
from cbrun.engine.sample.batch import SamplingRow, build_batch
from cbrun.engine.sample.sampler import SamplerOutput, sample
from cbrun.engine.sample.token_counts import TokenCounts
from cbrun.engine.spec_decode.speculative import accept_greedy
from cbrun.engine.spec_decode.speculative_rule import verify
from cbrun.engine.structured_output.bitmask import StepBitmask, build_step_bitmask, masked_argmax
from cbrun.engine.worker.async_batching import StepHandle, float_bits, floats_of
from cbrun.engine.worker.device import to_device

#: Bytes of float32 scratch one chunk of prompt log-probability rows may use (its copy and its log-softmax): a
#: scoring step's rows are scored this many at a time, so the scratch never grows with the step's rows.
PROMPT_LOGPROB_CHUNK_BYTES = 64 * 2**20

BLOCKED_MESSAGE = (
    "structured outputs: the constraint allows no token here (the tokenizer cannot express its next character)"
)


@dataclass
class VerifyEntry:
    """A sampled or host-processed request's verify entry: its logit rows start at ``first_row`` (one per
    proposal, then the bonus row); ``draft_probs`` is the draft's (proposals, V) q, None for n-gram proposals."""

    values: RowSampling
    proposals: list[int]
    first_row: int
    draft_probs: torch.Tensor | None


@dataclass
class LaunchedRows:
    """A plan's rows sampled or scored at launch: their sampling values, logit rows and rows of the step's
    read-back, and its prompt rows.

    ``output``: the device-side results once sampled, None when the batched call raised and the rows were redone
    alone (``results`` then holds each row's (error message or None, log-probabilities or None)).
    ``prompt_rows``: (values, first logit row, prompt positions) of each entry scoring its prompt.
    ``num_logprob_bits``, ``num_prompt_bits``: how many of the read-back's extra values are the rows'
    log-probabilities, then the prompt log-probabilities (``sample_at_launch`` packs them in that order).
    ``verify``: the verify entries verified at launch (not constrained: their bitmask comes later);
    ``verified`` their device results, None when verifying them together raised (they are then verified when
    the step is read, alone where needed); ``num_verify_ids``, ``num_verify_logprob_bits``: their share of the
    extras, after the prompt log-probabilities.
    """

    rows: list[RowSampling]
    logit_rows: list[int]
    sample_rows: list[int]
    prompt_rows: list[tuple[RowSampling, int, range]] = field(default_factory=list)
    output: SamplerOutput | None = None
    results: list[tuple[str | None, dict[int, float] | None]] | None = None
    num_logprob_bits: int = 0
    num_prompt_bits: int = 0
    verify: list[VerifyEntry] = field(default_factory=list)
    verified: SamplerOutput | None = None
    num_verify_ids: int = 0
    num_verify_logprob_bits: int = 0


class StepSampler:
    """Owns the penalised requests' token counts (``TokenCounts``) and turns a step's logits into its ``StepOutput``.

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
        self.token_counts = TokenCounts(vocab_size, device)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.rows_alone = rows_alone

    def release(self, request_index: int) -> None:
        """Forget a finished request's counts."""
        self.token_counts.release(request_index)

    def release_all(self) -> None:
        self.token_counts.release_all()

    # ---- at launch ------------------------------------------------------------------------------------------
    def launch_rows(
        self, plan: SchedulerOutput, draft_probs: dict[int, torch.Tensor] | None = None
    ) -> LaunchedRows | None:
        """The plan's entries that sample one token through the sampler (not the plain argmax, not a verify entry,
        not a constrained one), with their logit rows and read-back rows, its entries that score their prompt,
        and its verify entries that are not constrained (``draft_probs``: their draft distributions, by
        ``Request.index``); None when there are none."""
        if plan.plain_greedy:
            return None
        layout, sampling = plan.layout, plan.sampling
        launched = LaunchedRows([], [], [])
        for i, item in enumerate(plan.scheduled):
            if item.prompt_logprob_positions:
                launched.prompt_rows.append(
                    (sampling[item.request_index], layout.first_rows[i], item.prompt_logprob_positions)
                )
            if not (item.samples and item.needs_host_sampling):
                continue
            values = sampling[item.request_index]
            if item.spec_token_ids:
                if values.structured is None:
                    probs = draft_probs.get(item.request_index) if draft_probs else None
                    entry = VerifyEntry(values, list(item.spec_token_ids), layout.first_sample_rows[i], probs)
                    launched.verify.append(entry)
                continue
            # NOTE: a constrained row is sampled when the step is read, after its bitmask is built from its matcher
            if values.structured is None:
                launched.rows.append(values)
                launched.logit_rows.append(layout.first_sample_rows[i])
                launched.sample_rows.append(layout.first_samples[i])
        return launched if launched.rows or launched.prompt_rows or launched.verify else None

    @torch.inference_mode()
    def sample_at_launch(
        self, logits: torch.Tensor, argmax: torch.Tensor, launched: LaunchedRows, previous: StepHandle | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step's read-back: ``argmax`` (S,) with the launched rows replaced by their samples, a failed row's id
        negative (its error code, ``processing.encode_errors``), so the one copy of the step's tokens brings the
        errors too, and the extras that copy carries after the tokens: the rows' log-probabilities, then the
        prompt rows' scores (``_score_prompts``). The tokens stay on the device (async batching feeds them to the
        next step like the argmax).

        Args:
            logits: (N, V) the step's logits.
            argmax: (S,) int64, the step's argmax of its sample rows (changed in place).
            launched: from ``launch_rows``; its ``output`` (or ``results``) is filled for ``read``.
            previous: the step in flight (async batching): a penalised row's pending token is counted from its
                tokens on the device (``TokenCounts.count_pending``).
        """
        extras = []
        if launched.rows:
            argmax = self._sample_launched(logits, argmax, launched, previous)
            bits = launched.output.logprob_bits() if launched.output is not None else None
            if bits is not None:
                extras.append(bits)
                launched.num_logprob_bits = bits.shape[0]
        if launched.prompt_rows:
            extras.append(self._score_prompts(launched.prompt_rows, logits))
            launched.num_prompt_bits = extras[-1].shape[0]
        if launched.verify:
            try:
                launched.verified, read = self._verify_on_device(logits, launched.verify)
            except Exception as error:
                if not is_request_fault(error):
                    raise
                return argmax, extras  # verified again when the step is read, each entry alone if need be
            extras.append(read)
            launched.num_verify_ids = read.shape[0]
            bits = launched.verified.logprob_bits()
            if bits is not None:
                extras.append(bits)
                launched.num_verify_logprob_bits = bits.shape[0]
        return argmax, extras

    def _sample_launched(
        self, logits: torch.Tensor, argmax: torch.Tensor, launched: LaunchedRows, previous: StepHandle | None
    ) -> torch.Tensor:
        """``argmax`` with the launched rows' samples in place (``sample_at_launch``)."""
        rows = launched.rows
        pending = [r for r in rows if r.num_pending and r.params.penalised]
        if pending:
            rows_in_flight = [previous.sample_row_of[r.request_index] for r in pending]
            self.token_counts.count_pending(pending, previous.sampled, rows_in_flight)
        sample_rows = to_device(launched.sample_rows, torch.int64, argmax.device)
        if not (self.rows_alone and len(rows) > 1):
            index = to_device(launched.logit_rows, torch.int64, logits.device)
            try:
                batch = build_batch(
                    [SamplingRow(r, []) for r in rows], self.token_counts, self.eos_token_ids, logits.device
                )
                launched.output = sample(logits[index], batch, in_place=True)  # the index made a copy
                argmax[sample_rows] = launched.output.readback()
                return argmax
            except Exception as error:
                if not is_request_fault(error):
                    raise
        # Each row alone: after a request fault, or always under rows_alone (batch invariance on a device).
        results = self._isolated(lambda at: self._sample(logits, rows, launched.logit_rows, at, None), len(rows))
        launched.results = [_launched_result(r) for r in results]
        ids = [r[0] if not isinstance(r, Exception) else 0 for r in results]
        tokens = to_device(ids, torch.int64, logits.device)
        argmax[sample_rows] = tokens
        return argmax

    def fill_grammar_bitmask(self, plan: SchedulerOutput, logits: torch.Tensor) -> StepBitmask | None:
        """The launched step's token bitmask, uploaded to the logits' device: (N logit rows, ceil(V / 32)) int32,
        every token allowed in unconstrained rows; None when no planned request is constrained.

        Called right after the step is launched: the requests' matchers are already past their previous token
        (a constrained request never runs with a token still pending), and on a GPU the host fills the masks
        while the device computes the forward pass (the upload is from pinned memory, so it does not wait). The
        sampler applies it when the step is read, to every row in the same pass.
        """
        if plan.plain_greedy:  # a constrained request is never a plain greedy entry
            return None
        step = build_step_bitmask(plan, logits.shape[-1], logits.device.type == "cuda")
        if step is not None:
            step.on_device = step.bitmask.to(logits.device, non_blocking=True)
        return step

    # ---- when the step is read ------------------------------------------------------------------------------
    @torch.inference_mode()
    def read(
        self,
        plan: SchedulerOutput,
        handle: StepHandle,
        grammar: StepBitmask | None = None,
        draft_probs: dict[int, torch.Tensor] | None = None,
    ) -> StepOutput:
        """The step's ``StepOutput``: its read-back (the one copy of its tokens), then the rows read with the step.

        Args:
            plan: the launched plan.
            handle: its handle (``ModelRunner.launch``); ``handle.launched`` its rows sampled at launch.
            grammar: its token bitmask (``fill_grammar_bitmask``), or None.
            draft_probs: this step's draft distributions of sampled verify entries, by ``Request.index``.
        """
        token_ids = handle.token_ids()  # each sample row's token (argmax or sampled), in plan order
        out = StepOutput()
        layout = plan.layout
        if plan.plain_greedy:
            sampled = out.token_ids
            for item, at in zip(plan.scheduled, layout.first_samples):
                if item.samples:
                    sampled[item.request_index] = [token_ids[at]]
            return out
        if grammar is not None:
            for index in grammar.blocked:
                out.fail(index, BLOCKED_MESSAGE)
        launched = handle.launched
        verified_at_launch = launched is not None and launched.verified is not None
        constrained: list[tuple[RowSampling, int]] = []  # (values, logit row), sampled now with the bitmask
        to_verify: list[VerifyEntry] = []
        for i, item in enumerate(plan.scheduled):
            index = item.request_index
            if not item.samples or index in out.errors:
                continue
            first, at = layout.first_sample_rows[i], layout.first_samples[i]
            if item.spec_token_ids and item.needs_host_sampling:
                if launched is not None and plan.sampling[index].structured is None:
                    continue  # in ``launched.verify``: verified at launch
                probs = draft_probs.get(index) if draft_probs else None
                to_verify.append(VerifyEntry(plan.sampling[index], list(item.spec_token_ids), first, probs))
            elif item.spec_token_ids:
                out.token_ids[index] = accept_greedy(item.spec_token_ids, token_ids[at : at + item.num_sample_rows])
            elif item.needs_host_sampling and plan.sampling[index].structured is not None:
                constrained.append((plan.sampling[index], first))
            elif not item.needs_host_sampling:  # plain greedy: the device's argmax
                out.token_ids[index] = [token_ids[at]]
        if launched is not None:
            extra = handle.extra_ids()  # read with the tokens
            if launched.rows:
                self._read_launched(launched, token_ids, extra[: launched.num_logprob_bits], out)
            if launched.prompt_rows:
                scores = floats_of(extra[launched.num_logprob_bits :][: launched.num_prompt_bits])
                self._put_prompt_logprobs(launched.prompt_rows, scores, out)
            if verified_at_launch:
                self._read_verified(launched, extra[launched.num_logprob_bits + launched.num_prompt_bits :], out)
            elif launched.verify:  # verifying them together raised at launch
                to_verify.extend(launched.verify)
        bitmask = grammar.on_device if grammar is not None else None
        if constrained:
            self._sample_constrained(handle.logits, bitmask, constrained, out)
        if to_verify:
            self._verify_entries(handle.logits, to_verify, bitmask, out)
        return out

    def _read_launched(
        self, launched: LaunchedRows, token_ids: list[int], logprob_bits: list[int], out: StepOutput
    ) -> None:
        """Rows sampled at launch: their read-back tokens, errors and log-probabilities (``logprob_bits``, read
        back with them) into ``out``."""
        tokens = [token_ids[i] for i in launched.sample_rows]
        if launched.results is None:
            _, errors, logprobs = launched.output.to_host(tokens, logprob_bits)
            launched.results = [_launched_result((None, error, lp)) for error, lp in zip(errors, logprobs)]
        for values, token, (error, logprobs) in zip(launched.rows, tokens, launched.results):
            _put(out, values, error, [token], None if logprobs is None else [logprobs])

    def _read_verified(self, launched: LaunchedRows, extra: list[int], out: StepOutput) -> None:
        """The entries verified at launch: their committed tokens and log-probabilities from ``extra`` (the
        read-back's values after the prompt log-probabilities) into ``out``."""
        read = extra[: launched.num_verify_ids]
        bits = extra[launched.num_verify_ids :][: launched.num_verify_logprob_bits]
        results = self._verify_results(launched.verify, launched.verified, read, bits)
        self._put_verified(launched.verify, results, out)

    def _sample_constrained(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[tuple[RowSampling, int]], out: StepOutput
    ) -> None:
        """Constrained rows: the greedy ones whose only processing is the mask by ``masked_argmax`` (one batched
        op), the others through the sampler with their mask rows. A row whose masked logits hold NaN or nothing
        goes to the sampler too, so its error is the sampler's."""
        fast = [j for j, (values, _) in enumerate(rows) if values.params.masked_greedy]
        done = set()
        if fast:
            tokens = masked_argmax(logits, [rows[j][1] for j in fast], bitmask)
            for j, token in zip(fast, tokens):
                if token is not None:
                    out.token_ids[rows[j][0].request_index] = [token]
                    done.add(j)
        rest = [rows[j] for j in range(len(rows)) if j not in done]
        if not rest:
            return
        values = [v for v, _ in rest]
        logit_rows = [row for _, row in rest]
        mask = bitmask[to_device(logit_rows, torch.int64, bitmask.device)]
        results = self._isolated(lambda at: self._sample(logits, values, logit_rows, at, mask), len(values))
        for value, result in zip(values, results):
            if isinstance(result, Exception):
                out.fail(value.request_index, request_error_message("sampling", result))
                continue
            token, error, logprobs = result
            message = request_error_message("sampling", SamplingError(error)) if error is not None else None
            _put(out, value, message, [token], None if logprobs is None else [logprobs])

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

    def _sample(self, logits, values: list[RowSampling], rows: list[int], at: list[int], token_bitmask):
        batch = build_batch(
            [SamplingRow(values[i], []) for i in at], self.token_counts, self.eos_token_ids, logits.device
        )
        index = to_device([rows[i] for i in at], torch.int64, logits.device)
        mask = token_bitmask[to_device(at, torch.int64, token_bitmask.device)] if token_bitmask is not None else None
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
        batch = build_batch(rows, self.token_counts, self.eos_token_ids, device)
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
            out.logprobs[index] = logprobs


def _launched_result(result) -> tuple[str | None, dict[int, float] | None]:
    """(error message, log-probabilities) of a row: its ``_sample`` triple or its exception."""
    if isinstance(result, Exception):
        return request_error_message("sampling", result), None
    _, error, logprobs = result
    return (request_error_message("sampling", SamplingError(error)) if error is not None else None), logprobs
