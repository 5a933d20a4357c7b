"""Commit records: which parts of an object-store output count, and which rows each holds, without a rename.

An object store has no rename, so a part cannot appear under its final name only once it is whole. Instead each
part gets a name no other attempt can take, and counts only once its commit record exists::

    OUT/part-<attempt>-<seq>-r<first row>.parquet        one PUT (create-only): whole or absent
    OUT/_cbrun/commits/<the part's name>.json             one PUT (create-only), after the part: the commit

``attempt`` is unique to one run (its start time in ms and a random tag, so names sort by when they were written);
``seq`` counts the run's parts. A part without a record is garbage (a run killed between the two PUTs): the next
run deletes it. A record holds the part's row span ``[first_row, end_row)`` and a packed bitmap of the rows done
within it (one bit per row of the span) and of its error rows, so resume reads the records alone and its memory
grows with the number of parts, not rows.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
from dataclasses import dataclass, replace

import numpy as np

from cbrun.jobs.store.store import FsspecStore

#: Where the records live, below the output.
COMMITS_DIR = "_cbrun/commits"
#: An object-store part: ``part-<attempt>-<seq>-r<first row>.parquet``.
OBJECT_PART_RE = re.compile(r"^part-(?P<attempt>t\d{13}x[0-9a-f]{8})-(?P<seq>\d{6,})-r(?P<first>\d{12,})\.parquet$")


def new_attempt() -> str:
    """A run's attempt tag: its start time in ms, then 32 random bits (two runs never share one)."""
    return f"t{int(time.time() * 1000):013d}x{int.from_bytes(os.urandom(4), 'big'):08x}"


def object_part_name(attempt: str, seq: int, first_row: int) -> str:
    return f"part-{attempt}-{seq:06d}-r{first_row:012d}.parquet"


@dataclass(frozen=True)
class CommitRecord:
    """One committed part.

    Attributes:
        part: the part's object name (relative to the output).
        first_row, end_row: the span of row indices ``[first_row, end_row)`` its rows fall in.
        done: packed bits (``np.packbits``, big-endian bit order) over the span: the rows the part holds.
        errors: packed bits over the span: the rows with an error row among their output rows.
        num_output_rows, num_error_rows: output rows (samples) in the part, and of them error rows.
        name: the record's object name (``record_name``, or ``span_record_name`` for a Ray replica's span).
    """

    part: str
    first_row: int
    end_row: int
    done: bytes
    errors: bytes
    num_output_rows: int
    num_error_rows: int
    name: str = ""  # the record's own object name (relative to the output), once read back

    @classmethod
    def of_rows(cls, part: str, row_indices: np.ndarray, is_error: np.ndarray) -> CommitRecord:
        """The record of a part whose output rows have these ``row_indices`` (int64) and error flags (bool)."""
        first, end = (int(row_indices.min()), int(row_indices.max()) + 1) if len(row_indices) else (0, 0)
        done = np.zeros(end - first, dtype=bool)
        done[row_indices - first] = True
        errors = np.zeros(end - first, dtype=bool)
        errors[row_indices[is_error] - first] = True
        return cls(
            part,
            first,
            end,
            np.packbits(done).tobytes(),
            np.packbits(errors).tobytes(),
            len(row_indices),
            int(is_error.sum()),
        )

    def rows(self) -> np.ndarray:
        """The row indices the part holds (int64, ascending)."""
        return self.first_row + np.flatnonzero(self._bits(self.done))

    def error_rows(self) -> np.ndarray:
        return self.first_row + np.flatnonzero(self._bits(self.errors))

    def _bits(self, packed: bytes) -> np.ndarray:
        return np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=self.end_row - self.first_row).astype(bool)

    def to_json(self) -> bytes:
        value = {
            "part": self.part,
            "rows": [self.first_row, self.end_row],
            "done": base64.b64encode(self.done).decode(),
            "errors": base64.b64encode(self.errors).decode(),
            "num_output_rows": self.num_output_rows,
            "num_error_rows": self.num_error_rows,
        }
        return (json.dumps(value) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> CommitRecord:
        value = json.loads(data)
        return cls(
            value["part"],
            value["rows"][0],
            value["rows"][1],
            base64.b64decode(value["done"]),
            base64.b64decode(value["errors"]),
            value["num_output_rows"],
            value["num_error_rows"],
        )


def record_name(part: str) -> str:
    """The commit record's object name (relative to the output) of a part."""
    return f"{COMMITS_DIR}/{part}.json"


def span_record_name(first_row: int, end_row: int) -> str:
    """The commit record's object name of a Ray replica's span ``[first_row, end_row)``: every attempt at the span
    writes its own part but the same record name, create-only, so exactly one attempt's part counts."""
    return f"{COMMITS_DIR}/span-r{first_row:012d}-{end_row:012d}.json"


def add_span(target: np.ndarray, record: CommitRecord, bits: bytes, within: np.ndarray | None = None) -> None:
    """Set ``target[i]`` for the rows set in ``bits`` (``record.done`` or ``record.errors``) below
    ``len(target)`` (and, given ``within``, where it is True)."""
    end = min(record.end_row, len(target))
    if end <= record.first_row:
        return
    span = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=record.end_row - record.first_row)[
        : end - record.first_row
    ].astype(bool)
    if within is not None:
        span &= within[record.first_row : end]
    target[record.first_row : end] |= span


def read_records(store: FsspecStore) -> list[CommitRecord]:
    """Every commit record of an object-store output, in part-name order (the order the parts were written)."""
    names = store.list(COMMITS_DIR)
    found = store.read_many(names)  # NOTE: concurrently: resume reads one small object per part
    records = [replace(CommitRecord.from_json(found[name]), name=name) for name in names if name in found]
    return sorted(records, key=lambda r: r.part)
