"""Reading a launched step's logits and tokens into each request's tokens: the rows sampled at launch, the plain
greedy read, and any other step's grammar bitmask, masked greedy rows, batched sampling, speculative verification
and prompt log-probabilities."""

from __future__ import annotations

import time

import torch

from cbrun.engine.core.plan import SchedulerOutput
from cbrun.engine.core.request import Request
from cbrun.engine.core.stats import EngineStats
from cbrun.engine.sample.step import LaunchedRows, StepSampler, VerifyEntry
from cbrun.engine.spec_decode.speculative import accept_greedy
from cbrun.engine.structured_output.bitmask import StepBitmask, build_step_bitmask, masked_argmax, masked_greedy
from cbrun.engine.worker.async_batching import StepHandle


class StepReader:
    """Turns a step's results into the tokens of its unfinished requests, for the engine's ``_resolve``.

    It holds the engine's scheduler (its requests, and ``fail_request`` for a request whose grammar allows
    nothing), the engine's ``StepSampler`` and the engine's own counters (the grammar mask's), and owns no state.
    """

    def __init__(self, scheduler, sampler: StepSampler, counters: EngineStats) -> None:
        self.scheduler = scheduler
        self.sampler = sampler
        self.counters = counters

    def rows_sampled_at_launch(self, plan: SchedulerOutput) -> LaunchedRows | None:
        """The plan's entries that sample one token through the sampler (not the plain argmax, not a verify
        entry), with their logit rows and sampling rows; None when there are none."""
        if plan.plain_greedy:
            return None
        rows = LaunchedRows(self.sampler)
        row, sample = 0, 0
        for item in plan.scheduled:
            # NOTE: a constrained row is sampled when the step is read, after its bitmask is built from its matcher
            if (
                item.samples
                and item.needs_host_sampling
                and not item.spec_token_ids
                and self.scheduler.requests[item.request_index].structured is None
            ):
                rows.requests.append(self.scheduler.requests[item.request_index])
                rows.logit_rows.append(row + len(item.prompt_logprob_positions))
                rows.sample_rows.append(sample)
            row += len(item.prompt_logprob_positions) + item.num_sample_rows
            sample += item.num_sample_rows
        return rows if rows.requests else None

    def read_greedy(self, plan: SchedulerOutput, token_ids: list[int]) -> dict[int, int]:
        """A step of plain greedy entries: each sampling entry's token is the device's argmax.

        Returns:
            ``Request.index -> token`` of the unfinished requests.
        """
        requests = self.scheduler.requests
        sampled: dict[int, int] = {}
        sample = 0
        for item in plan.scheduled:
            if item.samples:
                # None once finished (async batching: found finished after this step was planned); token dropped.
                if item.request_index in requests:
                    sampled[item.request_index] = token_ids[sample]
                sample += 1
        return sampled

    def read_rows_of_plan(
        self,
        plan: SchedulerOutput,
        handle: StepHandle,
        token_ids: list[int],
        draft_probs: dict[int, torch.Tensor],
        grammar: StepBitmask | None,
    ) -> dict[int, int | list[int]]:
        """Any step: batched sampling, prompt log-probabilities and speculative verification where entries need them.

        Verify entries and prompt rows are gathered over the whole plan and handled in one batched call each
        (``cbrun.engine.sample.step.StepSampler``), on the logits' device; rows that sample one token were sampled
        at launch and are read by the engine's ``_resolve``.

        Args:
            draft_probs: this step's draft distributions of sampled requests, by ``Request.index``.
            grammar: the step's token bitmask, filled when it was launched (``fill_grammar_bitmask``), or None.

        Returns:
            ``Request.index -> token``, or the tokens a verify step commits, of the unfinished requests.
        """
        sampled: dict[int, int | list[int]] = {}
        bitmask = self._settle_grammar(grammar) if grammar is not None else None  # fails the blocked requests
        prompt_rows: list[tuple[Request, int, range]] = []
        to_sample: list[Request] = []  # constrained rows (the others were sampled at launch)
        sample_at: list[int] = []
        to_verify: list[VerifyEntry] = []
        row, sample = 0, 0
        for item in plan.scheduled:
            # None once finished (async batching: found finished after this step was planned); its token is dropped.
            request = self.scheduler.requests.get(item.request_index)
            num_sample_rows = item.num_sample_rows
            positions = item.prompt_logprob_positions
            if request is not None:
                if positions:
                    prompt_rows.append((request, row, positions))
                first = row + len(positions)
                if item.spec_token_ids and item.needs_host_sampling:
                    to_verify.append(
                        VerifyEntry(request, list(item.spec_token_ids), first, draft_probs.get(item.request_index))
                    )
                elif item.spec_token_ids:
                    sampled[item.request_index] = accept_greedy(
                        item.spec_token_ids, token_ids[sample : sample + num_sample_rows]
                    )
                elif item.samples and item.needs_host_sampling and request.structured is not None:
                    to_sample.append(request)
                    sample_at.append(first)
                elif item.samples and item.needs_host_sampling:
                    pass  # sampled when the step was launched (``rows_sampled_at_launch``)
                elif item.samples:  # plain greedy: the device's argmax
                    sampled[item.request_index] = token_ids[sample]
            row += len(positions) + num_sample_rows
            sample += num_sample_rows
        if prompt_rows:
            record_prompt_logprobs(prompt_rows, handle.logits)
        sample_mask = None
        if bitmask is not None and to_sample:
            to_sample, sample_at = self._masked_greedy(handle.logits, bitmask, to_sample, sample_at, sampled)
            sample_mask = bitmask[torch.tensor(sample_at, dtype=torch.int64, device=bitmask.device)]
        sampled.update(self.sampler.sample_rows(handle.logits, to_sample, sample_at, sample_mask))
        sampled.update(self.sampler.verify_entries(handle.logits, to_verify, bitmask))
        return sampled

    def fill_grammar_bitmask(self, plan: SchedulerOutput, handle: StepHandle) -> StepBitmask | None:
        """The launched step's token bitmask, uploaded to the logits' device: (N logit rows, ceil(V / 32)) int32,
        every token allowed in unconstrained rows; None when no planned request is constrained.

        Called right after the step is launched: the requests' matchers are already past their previous token
        (a constrained request never runs with a token still pending), and on a GPU the host fills the masks
        while the device computes the forward pass (the upload is from pinned memory, so it does not wait). The
        sampler applies it when the step is read, to every row in the same pass.
        """
        if plan.plain_greedy:  # a constrained request is never a plain greedy entry
            return None
        start = time.perf_counter()
        logits = handle.logits
        pin = logits.device.type == "cuda"
        step = build_step_bitmask(plan, self.scheduler.requests, logits.shape[0], logits.shape[-1], pin)
        if step is None:
            return None
        step.on_device = step.bitmask.to(logits.device, non_blocking=True)
        self.counters.num_grammar_mask_steps += 1
        self.counters.grammar_mask_seconds += time.perf_counter() - start
        return step

    def _settle_grammar(self, grammar: StepBitmask) -> torch.Tensor:
        """The bitmask on the device, after failing each request whose grammar allows no token at all (its
        tokenizer cannot express the constraint's next character): it fails alone, when its step is read."""
        for index in grammar.blocked:
            request = self.scheduler.requests.get(index)
            if request is not None:
                self.scheduler.fail_request(
                    request,
                    "structured outputs: the constraint allows "
                    "no token here (the tokenizer cannot express its next character)",
                )
        return grammar.on_device

    @staticmethod
    def _masked_greedy(
        logits: torch.Tensor, bitmask: torch.Tensor, requests: list[Request], rows: list[int], sampled: dict
    ) -> tuple[list[Request], list[int]]:
        """Take the greedy rows whose only processing is their grammar's mask (``masked_greedy``): their token is
        the argmax of their masked logits, all in one batched op (the sampler's own mask op). Returns the other
        rows and their logit rows, for the sampler; a row whose masked logits hold NaN or nothing goes there too,
        so its error is the sampler's."""
        fast = [i for i, request in enumerate(requests) if masked_greedy(request.sampling_params)]
        if not fast:
            return requests, rows
        tokens = masked_argmax(logits, [rows[i] for i in fast], bitmask)
        done = set()
        for i, token in zip(fast, tokens):
            if token is not None:
                sampled[requests[i].index] = token
                done.add(i)
        keep = [i for i in range(len(requests)) if i not in done]
        return [requests[i] for i in keep], [rows[i] for i in keep]


def record_prompt_logprobs(entries: list[tuple[Request, int, range]], logits: torch.Tensor) -> None:
    """Log-probability of each next prompt token, and whether it was the argmax, for every entry of the step in
    one ``log_softmax``. entries: (request, its first row in ``logits``, its prompt positions); logits: (N, V)."""
    rows = torch.tensor(
        [r for _, first, positions in entries for r in range(first, first + len(positions))],
        dtype=torch.int64,
        device=logits.device,
    )
    targets = torch.tensor(
        [
            t
            for request, _, positions in entries
            for t in request.prompt_token_ids[positions.start + 1 : positions.stop + 1]
        ],
        dtype=torch.int64,
        device=logits.device,
    )
    chosen = logits[rows].float()
    logprobs = torch.log_softmax(chosen, dim=-1).gather(1, targets[:, None])[:, 0].tolist()
    greedy = (chosen.argmax(dim=-1) == targets).tolist()
    start = 0
    for request, _, positions in entries:
        end = start + len(positions)
        request.prompt_logprobs.extend(logprobs[start:end])
        request.prompt_greedy.extend(greedy[start:end])
        start = end
