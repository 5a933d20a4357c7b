"""The run's progress bar and its ETA, counted in tokens rather than rows.

Under continuous batching most rows finish late and together, so rows per second early in a run say little about
its end (a run of 1,200 rows once showed ``3/1200 [00:03<25:30]`` for about 25 s of work). The ETA here is the
work left in tokens over the recent rate of tokens processed::

    work left = (prompt tokens + expected completion tokens) of the rows not finished  - tokens processed so far
    ETA       = work left / (tokens processed in the last ~30 s / those seconds)

A row's expected completion is its ``max_tokens`` until ``MIN_FINISHED`` requests have finished, then the mean
completion length so far (never above the rows' mean ``max_tokens``). Rows not read yet are counted at the mean
work of the rows read. Tokens processed are the engine's prefilled and decoded tokens plus prefix-cache hits (a
Ray driver, which has no engine, counts the tokens of the rows it has written).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Self

#: Finished requests before their mean completion length replaces ``max_tokens`` as the expected completion.
MIN_FINISHED = 16
#: Seconds of history the tokens/s rate is measured over.
RATE_WINDOW_S = 30.0
#: The bar: rows, the elapsed time, then the postfix (ETA, tokens/s, errors).
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rows [{elapsed}{postfix}]"


class TokenETA:
    """Estimates a run's remaining seconds from tokens (see the module docstring).

    Args:
        num_rows: rows this run has to finish.
    """

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self.rows_read = 0
        self.prompt_work = 0  # prompt tokens of the requests read
        self.requests_read = 0
        self.max_tokens_sum = 0  # max_tokens over the requests read
        self.requests_finished = 0
        self.completion_sum = 0
        self.history: deque[tuple[float, int]] = deque()  # (time, tokens processed) samples, oldest first

    def add_row(self, prompt_lengths: list[int], max_tokens: list[int]) -> None:
        """A row read and sent to the engine: each of its requests' prompt length and ``max_tokens``."""
        self.rows_read += 1
        self.prompt_work += sum(prompt_lengths)
        self.requests_read += len(max_tokens)
        self.max_tokens_sum += sum(max_tokens)

    def add_error_row(self) -> None:
        """A row read that never reaches the engine (no work)."""
        self.rows_read += 1

    def finish_request(self, num_completion_tokens: int) -> None:
        """A request finished with this many generated tokens."""
        self.requests_finished += 1
        self.completion_sum += num_completion_tokens

    @property
    def expected_completion(self) -> float:
        """Completion tokens expected of a request (see the module docstring)."""
        mean_max = self.max_tokens_sum / self.requests_read if self.requests_read else 0.0
        if self.requests_finished < MIN_FINISHED:
            return mean_max
        return min(self.completion_sum / self.requests_finished, mean_max)

    def total_work(self) -> float:
        """Tokens the whole run is expected to process: the rows read, and the rows not read at their mean."""
        if not self.rows_read:
            return 0.0
        read = self.prompt_work + self.requests_read * self.expected_completion
        return read * max(self.num_rows, self.rows_read) / self.rows_read

    def observe(self, processed_tokens: int, now: float | None = None) -> None:
        """Record the tokens processed since the run's start at ``now`` (``time.perf_counter()``)."""
        now = time.perf_counter() if now is None else now
        self.history.append((now, processed_tokens))
        while len(self.history) > 2 and now - self.history[1][0] >= RATE_WINDOW_S:
            self.history.popleft()

    def tokens_per_s(self) -> float:
        """Tokens processed per second over the last ``RATE_WINDOW_S`` seconds (0 before two observations)."""
        if len(self.history) < 2:
            return 0.0
        (t0, p0), (t1, p1) = self.history[0], self.history[-1]
        return (p1 - p0) / (t1 - t0) if t1 > t0 else 0.0

    def eta_s(self) -> float | None:
        """Seconds left, or None while the rate or the work is not known yet."""
        rate = self.tokens_per_s()
        if rate <= 0 or not self.rows_read:
            return None
        processed = self.history[-1][1]
        return max(self.total_work() - processed, 0.0) / rate


def format_eta(seconds: float | None) -> str:
    """``ETA 01:05`` / ``ETA 2:03:04``; ``ETA ?`` when unknown."""
    if seconds is None:
        return "ETA ?"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"ETA {hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"ETA {rest // 60:02d}:{rest % 60:02d}"


class JobProgress:
    """The tqdm bar of one run: rows, the token ETA, tokens/s generated and error rows.

    Args:
        num_rows: rows this run has to finish.
        processed_tokens: returns the tokens processed since the run's start (prefilled, decoded and prefix-cache
            hits) and the tokens generated; None: count the tokens of the rows finished (a Ray driver).
        enabled: show the bar (on stderr); off, every call still keeps the counts.
    """

    def __init__(self, num_rows: int, processed_tokens: Callable[[], tuple[int, int]] | None, enabled: bool = True):
        from tqdm import tqdm

        self.eta = TokenETA(num_rows)
        self.processed_tokens = processed_tokens
        self.row_tokens = 0  # prompt + completion tokens of the rows finished (without an engine to ask)
        self.generated = 0  # completion tokens of the rows finished
        self.candidates = 0
        self.errors = 0
        self.started = time.perf_counter()
        self.last_postfix = 0.0
        # A log file (no terminal) gets a line every 30 s rather than a redraw per row.
        interval = 0.5 if sys.stderr.isatty() else 30.0
        self.bar = tqdm(
            total=num_rows,
            disable=not enabled,
            desc="cbrun",
            dynamic_ncols=True,
            mininterval=interval,
            bar_format=BAR_FORMAT,
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        # NOTE: the postfix is refreshed at most every 0.5 s: the last rows' errors and the whole run's rate are
        # written once more, so the final bar agrees with the summary line
        self.bar.set_postfix_str(self.postfix(time.perf_counter()), refresh=False)
        self.bar.close()

    def row_finished(self, rows) -> None:
        """One input row's output rows (``cbrun.jobs.output.writer.OutputRow``) were written."""
        for row in rows:
            if row.finish_reason == "error":
                self.errors += 1
                continue
            completion = row.num_completion_tokens or 0
            self.eta.finish_request(completion)
            if self.processed_tokens is None:  # no engine here: the rows finished stand for the rows read
                self.eta.add_row([row.num_prompt_tokens], [completion])
            self.generated += completion
            self.row_tokens += row.num_prompt_tokens + completion
            if row.candidate_num_tokens is not None:
                self.candidates += len(row.candidate_num_tokens)
        self.bar.update(1)
        now = time.perf_counter()
        if now - self.last_postfix >= 0.5:
            self.last_postfix = now
            self.bar.set_postfix_str(self.postfix(now), refresh=False)

    def on_step(self, batch_tokens: int, seconds: float) -> None:
        """``LLMEngine.step_listener``: refresh the ETA and rate between rows (most rows finish late, together)."""
        now = time.perf_counter()
        if now - self.last_postfix >= 0.5:
            self.last_postfix = now
            self.bar.set_postfix_str(self.postfix(now), refresh=False)
            self.bar.update(0)  # redraws no more often than the bar's mininterval

    def postfix(self, now: float) -> str:
        """``ETA 00:21, 1234 gen tok/s, 0 errors`` (score mode: candidates/s, no ETA)."""
        seconds = max(now - self.started, 1e-9)
        if self.candidates:
            return f"{self.candidates / seconds:.1f} candidates/s, {count_errors(self.errors)}"
        if self.processed_tokens is None:
            processed, generated = self.row_tokens, self.generated
        else:
            processed, generated = self.processed_tokens()
        self.eta.observe(processed, now)
        return f"{format_eta(self.eta.eta_s())}, {generated / seconds:.0f} gen tok/s, {count_errors(self.errors)}"


def count_errors(count: int) -> str:
    """``"0 errors"``, ``"1 error"``, ``"2 errors"``: the progress bar's and the summary's words."""
    return f"{count} error{'' if count == 1 else 's'}"
