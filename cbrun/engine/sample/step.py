"""A step's reading of its logits: every sampled row, verified position and prompt row in a few batched calls.

``StepSampler`` is what the engine calls once per step. It gathers the rows that need more than the device's
argmax, builds their settings (``batch.build_batch``), runs ``sampler.sample`` and ``speculative_rule.verify`` on
the logits' device, and reads back only tokens, error codes and the log-probabilities asked for. A row that cannot
give a token fails alone (its error code). Rows that sample one token are sampled when the step is launched
(``sample_on_device``), so their tokens stay on the device for the next step (async batching), and are finished
when the step is read (``read_launched``); verify entries are read with the step (``verify_entries``). Should a batched call raise an exception of the request's own kind
(``cbrun.engine.core.faults.is_request_fault``), its rows are redone one at a time, so only the rows that raise alone fail:
a row's result does not depend on its batch, so the others are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cbrun.engine.core.faults import SamplingError, is_request_fault, request_error_message
from cbrun.engine.core.request import Request
from cbrun.engine.sample.batch import SamplingRow, build_batch
from cbrun.engine.sample.sampler import SamplerOutput, sample
from cbrun.engine.sample.token_counts import TokenCounts
from cbrun.engine.spec_decode.speculative_rule import verify
from cbrun.engine.worker.device import to_device


@dataclass
class LaunchedSample:
    """Rows sampled when their step was launched; read with the step (``StepSampler.read_launched``).

    ``results``: per request, (error message or None, log-probabilities or None), filled when first read;
    ``output``: the device-side results, or None when the batched call raised and rows were redone alone.
    """

    requests: list[Request]
    output: SamplerOutput | None
    results: list[tuple[str | None, dict[int, float] | None]] | None = None


class LaunchedRows:
    """A plan's rows sampled at launch: the requests, their logit rows and their rows of the step's tokens.

    ``sample`` is what the model runner calls on the device (``ModelRunner.launch``); ``read`` finishes the rows
    once the step's tokens are back.
    """

    def __init__(self, sampler: StepSampler) -> None:
        self.sampler = sampler
        self.requests: list[Request] = []
        self.logit_rows: list[int] = []
        self.sample_rows: list[int] = []
        self.launched: LaunchedSample | None = None

    def sample(self, logits: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
        """The step's read-back: ``argmax`` (S,) with the sampled rows replaced, a failed row's id negative (its
        error code, ``processing.encode_errors``), so the one copy of the step's tokens brings the errors too."""
        tokens, self.launched = self.sampler.sample_on_device(logits, self.requests, self.logit_rows)
        argmax[to_device(self.sample_rows, torch.int64, argmax.device)] = tokens
        return argmax

    def read(self, token_ids: list[int], unfinished: dict[int, Request]) -> dict[int, int]:
        """``Request.index -> token`` of the unfinished, not failed rows (``StepSampler.read_launched``)."""
        return self.sampler.read_launched(self.launched, [token_ids[i] for i in self.sample_rows], unfinished)


@dataclass
class VerifyEntry:
    """A sampled or host-processed request's verify entry: its logit rows start at ``first_row`` (one per
    proposal, then the bonus row); ``draft_probs`` is the draft's (proposals, V) q, None for n-gram proposals."""

    request: Request
    proposals: list[int]
    first_row: int
    draft_probs: torch.Tensor | None


class StepSampler:
    """Owns the penalised requests' token counts (``TokenCounts``) and turns a step's logits into tokens.

    Every call runs in inference mode, at launch (inside the model runner's) or when a step is read, so the
    counts are always inference tensors updated in inference mode.

    Args:
        vocab_size: V.
        device: the logits' device.
        eos_token_ids: the model's EOS ids.
        fail: called with (request, message) for a request whose own row failed.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: frozenset[int],
        fail: Callable[[Request, str], None],
    ) -> None:
        self.token_counts = TokenCounts(vocab_size, device)
        self.eos_token_ids = eos_token_ids
        self.fail = fail

    def release(self, request: Request) -> None:
        """Forget a finished request's counts."""
        self.token_counts.release(request.index)

    def release_all(self) -> None:
        self.token_counts.release_all()

    @torch.inference_mode()
    def sample_on_device(
        self, logits: torch.Tensor, requests: list[Request], rows: list[int], token_bitmask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, LaunchedSample]:
        """Sample the rows as the step is launched, leaving the tokens on the device (async batching feeds them to
        the next step as the device argmax is fed).

        Args:
            logits: (N, V) the step's logits; requests: the requests to sample (their unread tokens counted in
                their positions); rows: their rows of ``logits``.
            token_bitmask: (len(rows), ceil(V / 32)) int32 in xgrammar's layout, or None (``sampler.process``).

        Returns:
            ((len(rows),) int64 tokens on the device, a failed row's negative (``SamplerOutput.readback``), what
            ``read_launched`` reads once the step is done).
        """
        batch_rows = [SamplingRow(r, [], r.num_pending_tokens) for r in requests]
        index = to_device(rows, torch.int64, logits.device)
        try:
            batch = build_batch(batch_rows, self.token_counts, self.eos_token_ids, logits.device)
            out = sample(logits[index], batch, token_bitmask, in_place=True)  # the index made a copy
            return out.readback(), LaunchedSample(requests, out)
        except Exception as error:
            if not is_request_fault(error):
                raise
        results = self._isolated(
            lambda at: self._sample(logits, requests, rows, at, token_bitmask), requests, fail=False
        )
        tokens = [r[0] if r is not None and not isinstance(r, Exception) else 0 for r in results]
        launched = LaunchedSample(requests, None, [_launched_result(r) for r in results])
        return torch.tensor(tokens, dtype=torch.int64, device=logits.device), launched

    @torch.inference_mode()
    def read_launched(
        self, launched: LaunchedSample, tokens: list[int], unfinished: dict[int, Request]
    ) -> dict[int, int]:
        """Finish rows sampled at launch: fail those that failed, append log-probabilities.

        Args:
            launched: from ``sample_on_device``.
            tokens: the rows' tokens as read back with the step (a failed row's negative: its error code).
            unfinished: the engine's unfinished requests by ``Request.index`` (a request that finished while the
                step was in flight is skipped: its token is dropped).

        Returns:
            ``Request.index -> token`` of the requests that did not fail and are still unfinished.
        """
        if launched.results is None:
            _, errors, logprobs = launched.output.to_host(tokens)
            launched.results = [_launched_result((None, error, lp)) for error, lp in zip(errors, logprobs)]
        sampled: dict[int, int] = {}
        for request, token, (error, logprobs) in zip(launched.requests, tokens, launched.results):
            if request.index not in unfinished:
                continue
            if error is not None:
                self.fail(request, error)
                continue
            if logprobs is not None:
                request.logprobs.append(logprobs)
            sampled[request.index] = token
        return sampled

    @torch.inference_mode()
    def sample_rows(
        self, logits: torch.Tensor, requests: list[Request], rows: list[int], token_bitmask: torch.Tensor | None = None
    ) -> dict[int, int]:
        """One token for each request, from its logit row, when the step is read (constrained rows, whose
        bitmask needs their matcher past the previous token).

        Args:
            logits: (N, V) the step's logits on the device.
            requests: the requests to sample; rows: their rows of ``logits``.
            token_bitmask: (len(rows), ceil(V / 32)) int32 or None (``sampler.process``).

        Returns:
            ``Request.index -> token`` of the requests that did not fail; log-probabilities are appended to
            ``Request.logprobs``.
        """
        if not requests:
            return {}
        results = self._isolated(lambda at: self._sample(logits, requests, rows, at, token_bitmask), requests)
        sampled = {}
        for request, result in zip(requests, results):
            if result is None:
                continue
            token, error, logprobs = result
            if error is not None:
                self.fail(request, request_error_message("sampling", SamplingError(error)))
                continue
            if logprobs is not None:
                request.logprobs.append(logprobs)
            sampled[request.index] = token
        return sampled

    @torch.inference_mode()
    def verify_entries(
        self, logits: torch.Tensor, entries: list[VerifyEntry], token_bitmask: torch.Tensor | None = None
    ) -> dict[int, list[int]]:
        """The tokens each verify entry commits: its accepted proposals, then a replacement or the bonus token.

        Args:
            logits: (N, V) the step's logits on the device.
            entries: the verify entries; their rows of ``logits`` start at ``first_row``.
            token_bitmask: (N, ceil(V / 32)) int32 over the step's logit rows (a mask per verified position), on
                the logits' device, or None (``sampler.process``).

        Returns:
            ``Request.index -> tokens`` of the requests that did not fail (their log-probabilities appended).
        """
        if not entries:
            return {}
        results = self._isolated(
            lambda at: self._verify(logits, [entries[i] for i in at], token_bitmask),
            [entry.request for entry in entries],
        )
        committed = {}
        for entry, result in zip(entries, results):
            if result is None:
                continue
            tokens, error, logprobs = result
            if error is not None:
                self.fail(entry.request, request_error_message("sampling", SamplingError(error)))
                continue
            if entry.request.sampling_params.logprobs is not None:
                entry.request.logprobs.extend(logprobs)
            committed[entry.request.index] = tokens
        return committed

    def _isolated(self, run: Callable[[list[int]], list], requests: list[Request], fail: bool = True) -> list:
        """``run`` over all items at once; on a request fault, over each alone. An item that raises alone fails
        now (its result None), or with ``fail`` False its result is the exception, to fail it later."""
        try:
            return run(list(range(len(requests))))
        except Exception as error:
            if not is_request_fault(error):
                raise
        results = []
        for i, request in enumerate(requests):
            try:
                results.append(run([i])[0])
            except Exception as error:
                if not is_request_fault(error):
                    raise
                if fail:
                    self.fail(request, request_error_message("sampling", error))
                results.append(None if fail else error)
        return results

    def _sample(self, logits, requests, rows, at, token_bitmask):
        batch = build_batch(
            [SamplingRow(requests[i], [], requests[i].num_pending_tokens) for i in at],
            self.token_counts,
            self.eos_token_ids,
            logits.device,
        )
        index = torch.tensor([rows[i] for i in at], dtype=torch.int64, device=logits.device)
        mask = token_bitmask[torch.tensor(at, device=token_bitmask.device)] if token_bitmask is not None else None
        tokens, errors, logprobs = sample(logits[index], batch, mask, in_place=True).to_host()  # the index copied
        return list(zip(tokens, errors, logprobs))

    def _verify(self, logits, entries: list[VerifyEntry], token_bitmask=None):
        rows, logit_rows, proposals, drafted = [], [], [], []
        for entry in entries:
            spec = entry.proposals
            for i in range(len(spec) + 1):
                rows.append(SamplingRow(entry.request, spec[:i]))
                logit_rows.append(entry.first_row + i)
                proposals.append(spec[i] if i < len(spec) else -1)
                drafted.append(entry.draft_probs is not None and i < len(spec))
        device = logits.device
        batch = build_batch(rows, self.token_counts, self.eos_token_ids, device)
        draft_probs = has_draft = None
        if any(drafted):
            draft_probs = torch.zeros(len(rows), logits.shape[1], dtype=torch.float32, device=device)
            at = [j for j, d in enumerate(drafted) if d]
            draft_probs[torch.tensor(at, device=device)] = torch.cat(
                [e.draft_probs for e in entries if e.draft_probs is not None]
            ).to(device, torch.float32)
            has_draft = torch.tensor(drafted, device=device)
        index = torch.tensor(logit_rows, device=device)
        out = verify(
            logits[index],
            batch,
            torch.tensor(proposals, dtype=torch.int64, device=device),
            draft_probs,
            has_draft,
            token_bitmask[index] if token_bitmask is not None else None,
        )
        accepted = out.accepted.tolist()
        tokens, errors, logprobs = out.sampled.to_host()
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


def _launched_result(result) -> tuple[str | None, dict[int, float] | None]:
    """(error message, log-probabilities) of a row redone alone: its ``_sample`` triple or its exception."""
    if isinstance(result, Exception):
        return request_error_message("sampling", result), None
    _, error, logprobs = result
    return (request_error_message("sampling", SamplingError(error)) if error is not None else None), logprobs
