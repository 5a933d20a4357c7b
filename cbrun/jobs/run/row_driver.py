"""A row's trip through the job's mode, the same in the single-process row loop (``cbrun.jobs.run.row_loop``) and
in a Ray replica (``cbrun.jobs.run.replica``)::

    InputRow --prepare--> RowWork (its requests, in prefix-aware order: ``ordered``)   or an error OutputRow
    RequestOutput --collect--> the row's OutputRows, once all its requests are back (None before)

The driver keeps each row's carried input columns (``output.keep_columns``) from ``prepare`` until its output rows
leave, and attaches them; the loops around it only decide when to submit and where the rows go.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from cbrun.jobs.input.carry import carried_values
from cbrun.jobs.input.reader import InputRow
from cbrun.jobs.modes.mode import JobMode
from cbrun.jobs.modes.ordering import RowWork, order_by_prefix
from cbrun.jobs.output.writer import OutputRow


class RowDriver:
    """Rows into requests and requests' outputs back into rows, through one ``JobMode``.

    Args:
        mode: the job's mode (``cbrun.jobs.run.resources.MODES``).
        order_window: ``input.order_window``: rows ordered by prompt prefix within windows of this many.
    """

    def __init__(self, mode: JobMode, order_window: int) -> None:
        self.mode = mode
        self.order_window = order_window
        self._carried: dict[int, dict[str, Any]] = {}  # row index -> carried column values, until its rows leave

    def prepare(self, row: InputRow) -> RowWork | OutputRow:
        """The row's requests, or its error row (carried columns attached) when the job can tell it is bad."""
        self._carried[row.row_index] = carried_values(row)
        work = self.mode.prepare(row)
        if isinstance(work, OutputRow):
            self._attach([work])
        return work

    def ordered(self, work: Iterable[RowWork]) -> Iterator[RowWork]:
        """``work`` in prefix-aware order (``cbrun.jobs.modes.ordering.order_by_prefix``), a row's requests together."""
        return order_by_prefix(work, key=lambda w: w.prompt_token_ids, window=self.order_window)

    def collect(self, output) -> list[OutputRow] | None:
        """The row's output rows (carried columns attached) once ``output`` was its last request; else None."""
        rows = self.mode.collect(output)
        if rows is not None:
            self._attach(rows)
        return rows

    @property
    def num_in_flight(self) -> int:
        """Rows prepared whose output rows have not all come back."""
        return self.mode.num_in_flight

    def _attach(self, rows: list[OutputRow]) -> None:
        carried = self._carried.pop(rows[0].row_index, {})
        for row in rows:
            row.carried = carried
