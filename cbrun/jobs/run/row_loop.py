"""The row loop of one run (``_JobRun``): rows through the job's mode into ``engine.generate`` in prefix-aware
order, outputs back through the mode to the writer, bad rows straight to the writer as error rows, counting into
the ``JobSummary`` as it goes."""

from __future__ import annotations

import numpy as np

from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.modes.mode import JobMode
from cbrun.jobs.observe.progress import JobProgress
from cbrun.jobs.observe.timeline import TimelineRecorder, step_listeners
from cbrun.jobs.output.writer import OutputRow, PartWriter
from cbrun.jobs.run.row_driver import RowDriver
from cbrun.jobs.run.summary import JobSummary


class _JobRun:
    """The row loop of one run: rows through the job's mode into the engine, outputs back through it to the writer,
    counting as it goes."""

    def __init__(
        self,
        mode: JobMode,
        engine,
        writer: PartWriter,
        summary: JobSummary,
        order_window: int,
        max_in_flight: int,
        timeline: TimelineRecorder | None = None,
    ):
        #: rows through the mode (None: a counter of rows a Ray replica ran, ``tally`` / ``count`` only)
        self.driver = RowDriver(mode, order_window) if mode is not None else None
        self.timeline = timeline
        self.engine = engine
        self.writer = writer
        self.summary = summary
        self.max_in_flight = max_in_flight
        self.progress: JobProgress | None = None

    def run(self, reader: PromptReader, done: np.ndarray, progress: bool) -> None:
        assert self.driver is not None, "a counter runs no rows"
        stats = self.engine.stats
        self.processed_at_start = stats.num_computed_tokens + stats.num_cached_prompt_tokens
        self.generated_at_start = stats.num_generated_tokens
        timeline = self.timeline
        with JobProgress(int((~done).sum()), self._tokens, enabled=progress) as self.progress:
            self.engine.step_listener = step_listeners(self.progress.on_step, timeline and timeline.on_step)
            try:
                for output in self.engine.generate(self._requests(reader, done), max_in_flight=self.max_in_flight):
                    rows = self.driver.collect(output)
                    if rows is not None:
                        self._finish(rows)
                assert not self.driver.num_in_flight, f"{self.driver.num_in_flight} rows never finished"
            finally:
                # NOTE: rows already finished are committed even when the run is interrupted (Ctrl-C).
                self.engine.step_listener = None
                self.writer.commit()
                if timeline is not None:
                    timeline.close()

    def _tokens(self) -> tuple[int, int]:
        """Tokens processed (prefilled, decoded, prefix-cache hits) and generated since the run's start."""
        stats = self.engine.stats
        return (
            stats.num_computed_tokens + stats.num_cached_prompt_tokens - self.processed_at_start,
            stats.num_generated_tokens - self.generated_at_start,
        )

    def _requests(self, reader: PromptReader, done: np.ndarray):
        """The requests of the rows not done, in prefix-aware order (``input.order_window``), a row's together."""
        assert self.driver is not None
        for item in self.driver.ordered(self._row_work(reader, done)):
            yield from item.requests

    def _row_work(self, reader: PromptReader, done: np.ndarray):
        """Each good row's requests as a ``RowWork``; bad rows go to the writer as error rows on the spot."""
        assert self.driver is not None
        for row in reader.iter_rows(done):
            work = self.driver.prepare(row)
            if isinstance(work, OutputRow):
                self.progress.eta.add_error_row()
                self._finish([work])
            else:
                self.progress.eta.add_row(
                    [len(r[1]) for r in work.requests], [r[2].max_new_tokens for r in work.requests]
                )
                yield work

    def _finish(self, rows: list[OutputRow]) -> None:
        """Hand one input row's output rows (its samples) to the writer as one group, and count them."""
        self.count(rows)
        self.progress.row_finished(rows)

    def count(self, rows: list[OutputRow]) -> None:
        """Hand one input row's output rows to the writer as one group and add them to the summary."""
        committed = self.writer.add_group(rows)
        self.tally(rows)
        if committed and self.timeline is not None:
            # NOTE: the timeline is flushed with each part, so a killed run's timeline covers its committed rows
            self.timeline.record(flush=True)

    def tally(self, rows: list[OutputRow]) -> None:
        """Add one input row's output rows to the summary (rows a Ray replica committed itself)."""
        summary = self.summary
        summary.num_rows += 1
        summary.num_output_rows += len(rows)
        for row in rows:
            if row.finish_reason == "error":
                summary.num_errors += 1
            else:
                summary.num_prompt_tokens += row.num_prompt_tokens
                summary.num_generated_tokens += row.num_completion_tokens or 0
                if row.candidate_num_tokens is not None:
                    summary.num_candidates += len(row.candidate_num_tokens)
                    summary.num_scored_tokens += sum(row.candidate_num_tokens)
