"""The job-mode protocol: what a kind of job (generate, score, ...) adds between the reader and the writer.

A mode owns the rows it has turned into requests until their outputs are all back. The job run holds one mode
object and never asks which one it is::

    InputRow --mode.prepare--> RowWork (requests) --engine--> RequestOutput --mode.collect--> [OutputRow, ...]
        \\--------------- or an error OutputRow (a row the mode can tell is bad) ---------------> writer

A new mode (OpenAI batch requests, lm-eval requests, ...) is one class with these three members, registered in
``cbrun.jobs.run.resources.MODES`` under its ``input.mode`` name. Request ids are ``(row_index, k)``: k is the sample index in
generate mode, the candidate index in score mode.
"""

from __future__ import annotations

from typing import Protocol

from cbrun.jobs.input.reader import InputRow
from cbrun.jobs.modes.ordering import RowWork
from cbrun.jobs.output.writer import OutputRow


class JobMode(Protocol):
    """Turns input rows into engine requests, and engine outputs back into output rows."""

    def prepare(self, row: InputRow) -> RowWork | OutputRow:
        """The row's requests, or its error row when the row cannot run (naming the row and the cause).

        A row that gets a ``RowWork`` is in flight from here until ``collect`` returns its output rows.
        """

    def collect(self, output) -> list[OutputRow] | None:
        """Record one finished ``RequestOutput``; return the row's output rows once its last request is back
        (they are committed together, in one part), else None."""

    @property
    def num_in_flight(self) -> int:
        """Rows prepared whose output rows are not all back yet (0 once a run has drained the engine)."""
