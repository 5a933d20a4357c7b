"""The output's one owner: ``OutputDir``, over the output's ``Store``, the same for a local directory and an object
store. It owns the fingerprint file, which rows are done, the parts' appender, the lock (or lease), the finished
marker and stats, cbrun's other metadata files, and compaction; nothing else writes into the output.

Layout (data readers skip names starting with "_" or ".", so ``pq.read_table(OUT)`` reads the parts alone)::

    OUT/part-....parquet             committed rows (``cbrun.jobs.output.writer``)
    OUT/_SUCCESS                     the job finished (written last)
    OUT/_cbrun/job.json              the job's fingerprint (``cbrun.jobs.output.fingerprint``)
    OUT/_cbrun/stats.json            the last run's summary, once the job finished
    OUT/_cbrun/<name>                cbrun's other files (the split of the rows, a shard's summary, timelines)
    OUT/_cbrun/lock-0-of-1           a local run's lock (``cbrun.jobs.output.lock``)
    OUT/_cbrun/lease-0-of-1.json     an object-store run's lease (``cbrun.jobs.output.lease``)
    OUT/_cbrun/commits/<part>.json   an object-store part's commit record (``cbrun.jobs.output.commits``)

How parts are committed and read back differs by store, and is the owner's ``parts`` (``PartLog``): a local
directory renames each part into place and reads which rows are done from the parts themselves
(``cbrun.jobs.output.local_parts``); an object store has no rename, so a part counts once its commit record exists
(``cbrun.jobs.output.object_parts``). Outputs of older cbrun versions keep ``job.json`` and ``stats.json`` at the
top; they are read there and removed by the next run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from cbrun.jobs.output.fingerprint import fingerprint_differences
from cbrun.jobs.output.local_parts import LocalParts
from cbrun.jobs.output.lock import CBRUN_DIR, Shard
from cbrun.jobs.output.object_parts import ObjectParts
from cbrun.jobs.output.part_log import (
    CLEARED_META,
    JOB_FILE,
    STATS_FILE,
    SUCCESS_FILE,
    FingerprintMismatch,
    OutputState,
    PartLog,
)
from cbrun.jobs.output.writer import OUTPUT_SCHEMA, PartWriter, read_parts
from cbrun.jobs.store.store import FsspecStore, LocalStore, Store, open_store, read_json, write_json

logger = logging.getLogger("cbrun")

__all__ = [
    "JOB_FILE",
    "STATS_FILE",
    "SUCCESS_FILE",
    "FingerprintMismatch",
    "OutputDir",
    "OutputState",
    "open_output",
    "read_output",
]


class OutputDir:
    """The one owner of an output: fingerprint, done rows, appender, lock, finished marker, stats, metadata.

    A run holds ``lock`` from before ``open`` to its end; ``check`` tells whether the output may take the job
    (touching nothing); ``open`` reads which rows are done; ``start`` makes the output ready and returns the
    ``PartWriter`` that is its only appender; ``mark_finished`` writes stats.json and _SUCCESS.

    Args:
        store: the output's files (``open_output`` picks it from the path).
        shard: this process's share of the output (``cbrun.jobs.output.lock``).
    """

    def __init__(self, store: Store, shard: Shard = Shard()) -> None:
        self.store = store
        self.shard = shard
        #: The output's local directory; None on an object store (where each writer commits its own parts and
        #: nothing is recorded beside them on this machine).
        self.local_dir: Path | None = Path(store.root) if isinstance(store, LocalStore) else None
        self.parts: PartLog = _part_log(store)
        self.lock = self.parts.lock(shard)

    @property
    def output_dir(self) -> Any:
        """The output as named: a local ``Path``, or the object-store URI."""
        return self.local_dir if self.local_dir is not None else self.store.root

    @property
    def cbrun_dir(self) -> Any:
        """Where cbrun's own files live: a local ``Path``, or a URI."""
        return self.local_dir / CBRUN_DIR if self.local_dir is not None else self.store.path(CBRUN_DIR)

    # ---- the job file, stats and metadata ------------------------------------------------------------------------
    def read_job_file(self) -> dict[str, Any] | None:
        """The recorded fingerprint (``_cbrun/job.json``, else an older cbrun's ``job.json``); None when none."""
        return self._read_first(f"{CBRUN_DIR}/{JOB_FILE}", JOB_FILE)

    def job_file_bytes(self) -> bytes | None:
        """``_cbrun/job.json`` as written (its hash names the job in an export); None when absent."""
        return self.store.read(f"{CBRUN_DIR}/{JOB_FILE}")

    def write_job_file(self, fingerprint: dict[str, Any]) -> None:
        write_json(self.store, f"{CBRUN_DIR}/{JOB_FILE}", fingerprint)

    def write_meta(self, name: str, value: dict[str, Any]) -> None:
        """Write cbrun's own JSON file ``_cbrun/<name>`` (the split of the rows, a shard's summary, ...)."""
        write_json(self.store, f"{CBRUN_DIR}/{name}", value)

    def read_meta(self, name: str) -> dict[str, Any] | None:
        """cbrun's own JSON file ``_cbrun/<name>``; None when it is absent."""
        value = read_json(self.store, f"{CBRUN_DIR}/{name}")
        return None if value is None else dict(value)

    def meta_path(self, name: str) -> str:
        """Where cbrun's own file ``_cbrun/<name>`` lives (for a writer that streams it: a timeline, a report)."""
        return self.store.path(f"{CBRUN_DIR}/{name}")

    def is_finished(self) -> bool:
        return self.store.read(SUCCESS_FILE) is not None

    def clear_finished(self) -> None:
        """Remove the finished marker and the stats (an older cbrun's too)."""
        for name in (SUCCESS_FILE, f"{CBRUN_DIR}/{STATS_FILE}", STATS_FILE):
            self.store.delete(name)

    def write_finished(self, stats: dict[str, Any]) -> None:
        """Write stats.json, then the empty _SUCCESS marker (a reader that sees the marker finds the stats)."""
        write_json(self.store, f"{CBRUN_DIR}/{STATS_FILE}", stats)
        self.store.write_atomic(SUCCESS_FILE, b"")

    def read_stats(self) -> dict[str, Any] | None:
        """The finished job's stats (an older cbrun's beside the parts); None when absent."""
        return self._read_first(f"{CBRUN_DIR}/{STATS_FILE}", STATS_FILE)

    def _read_first(self, *names: str) -> dict[str, Any] | None:
        for name in names:
            value = read_json(self.store, name)
            if value is not None:
                return dict(value)
        return None

    # ---- the job's rows ------------------------------------------------------------------------------------------
    def check(self, fingerprint: dict[str, Any], *, overwrite: bool = False) -> None:
        """Make sure the output may take this job; touches nothing.

        Raises:
            FingerprintMismatch: when job.json holds another fingerprint and ``overwrite`` is false.
            ValueError: when a local output path exists and is not a directory.
        """
        if self.local_dir is not None and self.local_dir.exists() and not self.local_dir.is_dir():
            raise ValueError(f"output path {str(self.local_dir)!r} exists and is not a directory")
        old = None if overwrite else self.read_job_file()
        if old is None:
            return
        changed = fingerprint_differences(old, fingerprint)
        if "shards.count" in changed:
            others = [c for c in changed if c != "shards.count"]
            raise FingerprintMismatch(
                f"output directory {str(self.output_dir)!r} holds a job split into {old['shards']['count']} "
                f"shard(s), but this run splits it into {fingerprint['shards']['count']} (--shard I/N, or none: 1); "
                f"continue it with the same N, or rerun with --overwrite to discard its results"
                + (f" (also changed: {', '.join(others)})" if others else "")
            )
        if changed:
            raise FingerprintMismatch(
                f"output directory {str(self.output_dir)!r} holds the results of a different job (changed: "
                f"{', '.join(changed)}); rerun with --overwrite to discard them, or choose another --output"
            )

    def open(
        self, fingerprint: dict[str, Any], num_rows: int, *, overwrite: bool = False, retry_errors: bool = False
    ) -> OutputState:
        """Check that the output may take this job and read which of its rows are done. Needs the lock.

        Args:
            fingerprint: the job's ``job_fingerprint``.
            num_rows: rows the job covers.
            overwrite: the output's results will be discarded: nothing is done.
            retry_errors: rows with an error row are taken out of the output (and the finished marker removed),
                so that this run computes them again: afterwards each row is in the output once, as before.

        Raises:
            FingerprintMismatch: when the output holds another job's results (or parts but no job.json) and
                ``overwrite`` is false.
            ValueError: when a local output path exists and is not a directory.
        """
        assert self.lock.held, "open the output under its lock"
        self.check(fingerprint, overwrite=overwrite)
        if overwrite:
            return OutputState(done=np.zeros(num_rows, dtype=bool))
        if self.read_job_file() is None and self.parts.has_parts():
            raise FingerprintMismatch(
                f"output directory {str(self.output_dir)!r} holds {self.parts.what} but no job.json; rerun with "
                f"--overwrite to discard them, or choose another --output"
            )
        num_duplicates = self.parts.recover()
        state = self.read_state(num_rows)
        state.num_duplicates = num_duplicates
        if retry_errors and len(state.error_rows):
            self.clear_finished()
            self.remove_rows(state.error_rows)
            logger.info("retrying %d rows with error rows: taken out of %s", len(state.error_rows), self.output_dir)
            state = self.read_state(num_rows)
        return state

    def read_state(self, num_rows: int, within: np.ndarray | None = None) -> OutputState:
        """The done bitmap and error counts of rows 0..num_rows-1 (rows past it, from a run with a larger limit,
        are ignored); ``within``: bool over those rows (a shard's), only these are read; None: all."""
        return self.parts.read_state(num_rows, within)

    def done_rows(self, num_rows: int) -> np.ndarray:
        """Bool array over row indices 0..num_rows-1, True for rows in a committed part."""
        return self.read_state(num_rows).done

    def remove_duplicates(self) -> int:
        """Keep each row in its earliest part only, rewriting later parts without it; returns copies removed."""
        return self.parts.remove_duplicates()

    def remove_rows(self, row_indices: np.ndarray) -> int:
        """Take rows (all their output rows) out of the committed parts; returns the output rows removed."""
        return self.parts.remove_rows(row_indices)

    def start(
        self,
        fingerprint: dict[str, Any],
        commit_every_rows: int,
        commit_every_seconds: float,
        *,
        overwrite: bool = False,
        carried_fields: Sequence[pa.Field] = (),
    ) -> PartWriter:
        """Make the output ready to take rows (``prepare``, the finished marker removed); returns its appender
        (``carried_fields``: the input columns its rows carry, ``cbrun.jobs.input.carry``)."""
        self.prepare(fingerprint, overwrite=overwrite)
        self.clear_finished()
        return self.parts.writer(commit_every_rows, commit_every_seconds, carried_fields, self.lock)

    def prepare(self, fingerprint: dict[str, Any], *, overwrite: bool = False) -> None:
        """Check, clear when ``overwrite``, remove what a killed run left half-written, write job.json (removing an
        older cbrun's job.json and stats.json beside the parts).

        Raises:
            FingerprintMismatch: see ``check``.
        """
        self.check(fingerprint, overwrite=overwrite)
        if self.local_dir is not None:
            self.local_dir.joinpath(CBRUN_DIR).mkdir(parents=True, exist_ok=True)
        if overwrite:
            self.clear()
        self.parts.remove_stray(self.shard)
        if self.local_dir is not None:  # NOTE: only an older cbrun, always local, wrote them beside the parts
            for name in (JOB_FILE, STATS_FILE):
                self.store.delete(name)
        # NOTE: rewritten when it differs (a fingerprint of an older cbrun records fewer keys): it is checked again.
        if self.read_job_file() != fingerprint:
            self.write_job_file(fingerprint)

    def clear(self) -> None:
        """Remove every cbrun file of the output: parts, job and stats files, the split, shard summaries and
        timelines (other files are left alone; the lock stays)."""
        self.parts.clear()
        for name in (SUCCESS_FILE, JOB_FILE, STATS_FILE, f"{CBRUN_DIR}/{JOB_FILE}", f"{CBRUN_DIR}/{STATS_FILE}"):
            self.store.delete(name)
        for name in self.store.list(CBRUN_DIR):
            if "/" not in name.removeprefix(f"{CBRUN_DIR}/") and any(
                Path(name).match(pattern) for pattern in CLEARED_META
            ):
                self.store.delete(name)

    def write_empty_part_if_none(self, schema: pa.Schema) -> None:
        """Commit one part with no rows and the full ``schema`` when the output has no part (an empty job), so
        that readers of the output find its columns."""
        if not self.parts.has_parts():
            self.parts.write_empty_part(schema, self.shard)

    def mark_finished(self, fingerprint: dict[str, Any], stats: dict[str, Any]) -> None:
        """Write job.json (when it differs), stats.json, then the empty _SUCCESS marker."""
        self.prepare(fingerprint)
        self.parts.settle()
        self.write_finished(stats)

    def read_rows(self, columns: list[str] | None = None) -> pa.Table:
        """Every committed row, in part order (``cbrun.jobs.output.output_dir.read_output``)."""
        table = read_parts(self.parts.part_files())
        if table is None:
            return OUTPUT_SCHEMA.empty_table().select(columns or OUTPUT_SCHEMA.names)
        return table.select(columns) if columns is not None else table

    def held_locks(self) -> dict[str, dict] | None:
        """{"I/N": holder record} of the shards a live run holds now, taking no lock; None when unknowable."""
        return self.parts.held_locks()

    def compact(self, shards: list[Shard], target_bytes: int) -> tuple[int, int, int]:
        """Merge the committed parts into parts of about ``target_bytes`` (``cbrun.jobs.output.compact``); the
        caller holds every shard's lock. Returns (parts before, parts after, parts written)."""
        return self.parts.compact(shards, target_bytes)


def _part_log(store: Store) -> PartLog:
    """The part log of ``store``'s kind: renamed parts in a local directory, recorded parts on an object store."""
    if isinstance(store, LocalStore):
        return LocalParts(store)
    assert isinstance(store, FsspecStore), store
    return ObjectParts(store)


def open_output(output: str | Path, shard: Shard = Shard(), endpoint_url: str | None = None) -> OutputDir:
    """The owner of an output: the one place its path is classified (``open_store``: a local directory or an
    object-store URI, whose store talks to ``endpoint_url``)."""
    return OutputDir(open_store(output, endpoint_url), shard)


def read_output(output_dir: str | Path, columns: list[str] | None = None) -> pa.Table:
    """All committed rows of an output (a directory or an object-store URI) as one table, in part order (not
    sorted by row_index): every column of the parts, the carried input columns (``output.keep_columns``)
    included (``OutputDir.read_rows``).

    NOTE: ``pq.read_table(output_dir)`` reads the same rows of a finished job (it skips ``_cbrun/``, ``_SUCCESS``
    and temporary files); this reads the committed parts alone, in commit order.
    """
    return open_output(output_dir).read_rows(columns)
