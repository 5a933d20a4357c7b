"""What the output's owner (``cbrun.jobs.output.output_dir.OutputDir``) and its two part logs share: the file names,
the state of an output's rows (``OutputState``), the ``PartLog`` protocol that ``LocalParts`` and ``ObjectParts``
implement, and how parts are grouped for compaction."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from cbrun.jobs.output.lock import Shard
from cbrun.jobs.output.writer import PartWriter

JOB_FILE = "job.json"
SUCCESS_FILE = "_SUCCESS"
STATS_FILE = "stats.json"
#: cbrun's files in ``_cbrun/`` that ``--overwrite`` removes with the results (besides job.json and stats.json).
CLEARED_META = ("shards.json", "stats-*-of-*.json", "timeline-*.jsonl")


class FingerprintMismatch(ValueError):
    """The output holds another job's results."""


@dataclass
class OutputState:
    """What the committed parts of an output hold, for the rows of one job.

    Attributes:
        done: bool over row indices 0..num_rows-1, True for rows in a committed part.
        error_rows: row indices (sorted) of done rows with an error row among their output rows.
        num_output_rows / num_error_rows: output rows (samples) of the done rows, and of them the error rows.
        num_duplicates: row copies found in later parts and removed.
    """

    done: np.ndarray
    error_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    num_output_rows: int = 0
    num_error_rows: int = 0
    num_duplicates: int = 0


class OutputLockLike(Protocol):
    """A run's hold on its share of an output: ``OutputLock`` (flock) or ``Lease`` (an expiring lease object)."""

    shard: Shard

    @property
    def held(self) -> bool: ...

    def acquire(self) -> None: ...

    def release(self) -> None: ...


class PartLog(Protocol):
    """How an output's parts are committed, read back, rewritten and cleared: the one thing that differs between a
    local directory (``LocalParts``) and an object store (``ObjectParts``)."""

    #: What a part without a job file is called in messages ("part files", "commit records").
    what: str

    def lock(self, shard: Shard) -> OutputLockLike:
        """The lock (or lease) of ``shard``'s share of the output."""
        ...

    def has_parts(self) -> bool: ...

    def num_parts(self) -> int: ...

    def part_files(self) -> Iterable[Any]:
        """The committed parts (paths, or object files opened as they are reached), in the order written."""
        ...

    def read_state(self, num_rows: int, within: np.ndarray | None = None) -> OutputState: ...

    def remove_stray(self, shard: Shard) -> None:
        """Delete the temporary files a killed run left half-written (its own shard's only, in a sharded output)."""
        ...

    def recover(self) -> int:
        """Make the parts consistent for a run that resumes: parts a killed run left uncommitted deleted, a row
        found in two parts kept in its earliest; returns the row copies removed."""
        ...

    def remove_duplicates(self) -> int: ...

    def remove_rows(self, row_indices: np.ndarray) -> int: ...

    def writer(
        self, commit_every_rows: int, commit_every_seconds: float, carried_fields: Sequence[pa.Field], lock
    ) -> PartWriter: ...

    def write_empty_part(self, schema: pa.Schema, shard: Shard) -> None: ...

    def clear(self) -> None:
        """Delete every part (and commit record); other files are left alone."""
        ...

    def settle(self) -> None:
        """What the finish needs beyond the parts being committed (an object store: drop retried spans' copies)."""
        ...

    def held_locks(self) -> dict[str, dict] | None: ...

    def compact(self, shards: list[Shard], target_bytes: int) -> tuple[int, int, int]:
        """Merge small parts into parts of about ``target_bytes``; (parts before, parts after, parts written)."""
        ...


def groups_by_size(sizes: list[int], target_bytes: int) -> list[list[int]]:
    """Split consecutive parts (by their sizes) into runs of about ``target_bytes``; only runs of two or more
    parts are worth merging, so single parts are left out."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if current and total + size > target_bytes:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    groups.append(current)
    return [g for g in groups if len(g) > 1]
