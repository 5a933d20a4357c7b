"""Per-request token counts on the device, for the repetition, presence and frequency penalties."""

from __future__ import annotations

import torch

from cbrun.engine.core.plan import RowSampling
from cbrun.engine.worker.device import to_device


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
        self, requests: list[RowSampling], extra_tokens: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The rows of ``requests``, brought up to date with their output, plus each entry's extra tokens.

        Args:
            requests: P requests' sampling values (one may appear several times, e.g. once per verified position).
            extra_tokens: per entry, tokens counted as output after the request's own (speculative proposals
                before a verified position, or earlier draft proposals).

        Returns:
            ((P,) int64 rows of ``counts``; (P, V) bool seen tokens, extra tokens included (a new tensor);
            (P, V) int32 counts of the extra tokens, or None when there are none).
        """
        rows = [self._row(request) for request in requests]
        self._count_new_outputs(requests)
        index = to_device(rows, torch.int64, self.device)
        seen = self.seen[index]
        extra = [(i, t) for i, tokens in enumerate(extra_tokens) for t in tokens]
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
