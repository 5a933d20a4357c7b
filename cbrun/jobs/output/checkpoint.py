"""The output directory's one owner: its lock, the job fingerprint, which rows are done, and the finished marker.

Layout (data readers skip names starting with "_" or ".", so ``pq.read_table(OUT)`` reads the parts alone)::

    OUT/part-000000.parquet ...      committed rows (``cbrun.jobs.output.writer``); .part-*.parquet.tmp while being written
    OUT/_SUCCESS                     the job finished (written last)
    OUT/_cbrun/job.json              the job's fingerprint (``cbrun.jobs.output.fingerprint``)
    OUT/_cbrun/stats.json            the last run's summary, once the job finished
    OUT/_cbrun/lock-0-of-1           the run's lock (``cbrun.jobs.output.lock``)

Outputs of older cbrun versions keep ``job.json`` and ``stats.json`` at the top; they are read there and moved into
``_cbrun/`` by the next run.

Which rows are done is read back from the committed parts themselves (their ``row_index`` and ``finish_reason``
columns only) into a bitmap of one byte per input row, 100 MB for a 100M-row input; nothing else is kept, so there
is no second record that could disagree with the parts. With ``n`` samples per row, a row is done when its
``row_index`` is in a committed part: the job commits all the samples of a row in the same part
(``PartWriter.add_group``), so a done row always has every sample. A row found in two parts (written by an older
cbrun, or by two runs without a lock) keeps the copy in its earliest part; ``open`` removes the later copies.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cbrun.jobs.output.fingerprint import fingerprint_differences
from cbrun.jobs.output.lock import CBRUN_DIR, OutputLock, Shard
from cbrun.jobs.output.output_dir import JOB_FILE, STATS_FILE, SUCCESS_FILE, OutputDir
from cbrun.jobs.output.writer import (
    PART_RE,
    TEMP_RE,
    PartWriter,
    committed_parts,
    conform_table,
    part_name,
    part_shard,
    write_part_atomically,
)
from cbrun.jobs.store.store import LocalStore

logger = logging.getLogger("cbrun")


class FingerprintMismatch(ValueError):
    """The output directory holds another job's results."""


@dataclass
class OutputState:
    """What the committed parts of an output directory hold, for the rows of one job.

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


class Checkpoint(OutputDir):
    """The one owner of an output directory: lock, fingerprint, done rows, finished marker, and its appender.

    A run holds ``lock`` (``with checkpoint.lock:``) from before ``open`` to its end; ``open`` checks that the
    directory may take the job and reads which rows are done; ``start`` makes it ready and returns the
    ``PartWriter`` that is its only appender; ``mark_finished`` writes stats.json and _SUCCESS.

    Args:
        output_dir: the output directory (created by the lock when missing).
        shard: this process's share of the output (``cbrun.jobs.output.lock``).
    """

    def __init__(self, output_dir: str | Path, shard: Shard = Shard()):
        self.output_dir = Path(output_dir)
        super().__init__(LocalStore(self.output_dir), self.output_dir)
        self.cbrun_dir = self.output_dir / CBRUN_DIR
        self.lock = OutputLock(self.output_dir, shard)

    @property
    def job_file(self) -> Path:
        return self.cbrun_dir / JOB_FILE

    def check(self, fingerprint: dict[str, Any], *, overwrite: bool = False) -> None:
        """Make sure the directory may take this job; touches nothing.

        Raises:
            FingerprintMismatch: when job.json holds another fingerprint and ``overwrite`` is false.
            ValueError: when the output path exists and is not a directory.
        """
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ValueError(f"output path {str(self.output_dir)!r} exists and is not a directory")
        old = None if overwrite else self.read_job_file()
        if old is None:
            return
        changed = fingerprint_differences(old, fingerprint)
        if "shards.count" in changed:
            raise FingerprintMismatch(
                f"output directory {str(self.output_dir)!r} holds a job split into {old['shards']['count']} "
                f"shard(s), but this run splits it into {fingerprint['shards']['count']} (--shard I/N, or none: 1); "
                f"continue it with the same N, or rerun with --overwrite to discard its results"
                + (
                    f" (also changed: {', '.join(c for c in changed if c != 'shards.count')})"
                    if len(changed) > 1
                    else ""
                )
            )
        if changed:
            raise FingerprintMismatch(
                f"output directory {str(self.output_dir)!r} holds the results of a different job (changed: "
                f"{', '.join(changed)}); rerun with --overwrite to discard them, or choose another --output"
            )

    def open(
        self, fingerprint: dict[str, Any], num_rows: int, *, overwrite: bool = False, retry_errors: bool = False
    ) -> OutputState:
        """Check that the directory may take this job and read which of its rows are done. Needs the lock.

        Args:
            fingerprint: the job's ``job_fingerprint``.
            num_rows: rows the job covers.
            overwrite: the directory's results will be discarded: nothing is done.
            retry_errors: rows with an error row are taken out of the output (and the finished marker removed),
                so that this run computes them again: afterwards each row is in the output once, as before.

        Raises:
            FingerprintMismatch: when the directory holds another job's results (or parts but no job.json) and
                ``overwrite`` is false.
            ValueError: when the output path exists and is not a directory.
        """
        assert self.lock.held, "open the output directory under its lock"
        self.check(fingerprint, overwrite=overwrite)
        if overwrite:
            return OutputState(done=np.zeros(num_rows, dtype=bool))
        if self.read_job_file() is None and committed_parts(self.output_dir):
            raise FingerprintMismatch(
                f"output directory {str(self.output_dir)!r} holds part files but no job.json; rerun with "
                f"--overwrite to discard them, or choose another --output"
            )
        num_duplicates = self.remove_duplicates()
        state = self.read_state(num_rows)
        state.num_duplicates = num_duplicates
        if retry_errors and len(state.error_rows):
            self.clear_finished()
            self.remove_rows(state.error_rows)
            logger.info("retrying %d rows with error rows: taken out of %s", len(state.error_rows), self.output_dir)
            state = self.read_state(num_rows)
        return state

    def read_state(self, num_rows: int, within: np.ndarray | None = None) -> OutputState:
        """The done bitmap and error counts of rows 0..num_rows-1, from the parts' row_index and finish_reason.

        Rows past ``num_rows`` (from a run with a larger limit) are ignored.

        Args:
            within: bool over rows 0..num_rows-1 (a shard's rows): only these rows are read; None: all.
        """
        done = np.zeros(num_rows, dtype=bool)
        failed = np.zeros(num_rows, dtype=bool)
        num_output_rows = num_error_rows = 0
        for part in committed_parts(self.output_dir):
            for batch in pq.ParquetFile(part).iter_batches(columns=["row_index", "finish_reason"], batch_size=65536):
                indices = batch.column(0).to_numpy()
                # NOTE: score-mode rows have a null finish_reason: not errors.
                is_error = pc.fill_null(pc.equal(batch.column(1), "error"), False).to_numpy(zero_copy_only=False)
                keep = indices < num_rows
                if within is not None:
                    keep[keep] = within[indices[keep]]
                indices, is_error = indices[keep], is_error[keep]
                done[indices] = True
                failed[indices[is_error]] = True
                num_output_rows += len(indices)
                num_error_rows += int(is_error.sum())
        return OutputState(done, np.flatnonzero(failed), num_output_rows, num_error_rows)

    def done_rows(self, num_rows: int) -> np.ndarray:
        """Bool array over row indices 0..num_rows-1, True for rows in a committed part."""
        return self.read_state(num_rows).done

    def remove_duplicates(self) -> int:
        """Keep each row in its earliest part only, rewriting later parts without it; returns copies removed.

        Never happens to a locked run's output; parts written by an older cbrun (an interrupt during a commit) or
        by two runs at once can hold a row twice.
        """
        seen = np.zeros(0, dtype=bool)
        later: dict[Path, np.ndarray] = {}
        for part in committed_parts(self.output_dir):
            indices = np.unique(pq.read_table(part, columns=["row_index"]).column(0).to_numpy())
            if len(indices) and indices[-1] >= len(seen):
                seen = np.concatenate([seen, np.zeros(int(indices[-1]) + 1 - len(seen), dtype=bool)])
            repeated = indices[seen[indices]]
            if len(repeated):
                later[part] = repeated
            seen[indices] = True
        if not later:
            return 0
        removed = sum(self._rewrite_without(part, rows) for part, rows in later.items())
        logger.warning(
            "cbrun: %s held %d rows written more than once (by an older cbrun, or by two runs at once); "
            "kept each row's copy in its earliest part and removed the later copies from %s",
            self.output_dir,
            len(np.unique(np.concatenate(list(later.values())))),
            ", ".join(p.name for p in later),
        )
        return removed

    def remove_rows(self, row_indices: np.ndarray) -> int:
        """Take rows (all their output rows) out of the committed parts; returns the output rows removed."""
        return sum(self._rewrite_without(part, row_indices) for part in committed_parts(self.output_dir))

    def _rewrite_without(self, part: Path, row_indices: np.ndarray) -> int:
        """Rewrite one part without the given rows, atomically (a part left empty is deleted)."""
        table = conform_table(pq.read_table(part))
        drop = pc.is_in(table.column("row_index"), value_set=pa.array(row_indices, pa.int64()))
        if not pc.any(drop).as_py():
            return 0
        kept = table.filter(pc.invert(drop))
        if kept.num_rows:
            write_part_atomically(part, kept)
        else:
            part.unlink()
        return table.num_rows - kept.num_rows

    def start(
        self,
        fingerprint: dict[str, Any],
        commit_every_rows: int,
        commit_every_seconds: float,
        *,
        overwrite: bool = False,
        carried_fields: Sequence[pa.Field] = (),
    ) -> PartWriter:
        """Make the directory ready to take rows (``prepare``, the finished marker removed); returns its appender
        (``carried_fields``: the input columns its rows carry, ``cbrun.jobs.input.carry``)."""
        self.prepare(fingerprint, overwrite=overwrite)
        self.clear_finished()
        return PartWriter(
            self.output_dir,
            commit_every_rows,
            commit_every_seconds,
            carried_fields=carried_fields,
            shard=self.lock.shard,
        )

    def prepare(self, fingerprint: dict[str, Any], *, overwrite: bool = False) -> None:
        """Check, create the directory, clear it when ``overwrite``, remove stray temporary files, write job.json
        (moving an older cbrun's job.json and stats.json into ``_cbrun/``).

        Raises:
            FingerprintMismatch: see ``check``.
        """
        self.check(fingerprint, overwrite=overwrite)
        self.cbrun_dir.mkdir(parents=True, exist_ok=True)
        if overwrite:
            self.clear()
        self.remove_temp_files()
        for name in (JOB_FILE, STATS_FILE):
            (self.output_dir / name).unlink(missing_ok=True)
        # NOTE: rewritten when it differs (a fingerprint of an older cbrun records fewer keys): it is checked again.
        if self.read_job_file() != fingerprint or not self.job_file.is_file():
            self.write_job_file(fingerprint)

    def clear(self) -> None:
        """Remove every cbrun file of the directory (other files are left alone; the lock stays)."""
        for path in self.output_dir.iterdir():
            if (
                path.name in (JOB_FILE, SUCCESS_FILE, STATS_FILE)
                or PART_RE.match(path.name)
                or TEMP_RE.match(path.name)
            ):
                path.unlink()
        for name in (JOB_FILE, STATS_FILE, "shards.json"):
            (self.cbrun_dir / name).unlink(missing_ok=True)
        for pattern in ("stats-*-of-*.json", "timeline-*.jsonl"):  # per-shard summaries; runs' timelines
            for path in self.cbrun_dir.glob(pattern):
                path.unlink()

    def remove_temp_files(self) -> list[Path]:
        """Delete the half-written files a killed run left behind; returns them."""
        # NOTE: a shard of a sharded run removes its own temporary files only: the others may be being written.
        shard = self.lock.shard
        stray = [
            p
            for p in self.output_dir.iterdir()
            if (m := TEMP_RE.match(p.name)) and (shard.count == 1 or part_shard(m) == shard)
        ]
        # NOTE: ``.NAME.tmp`` from older versions, ``.NAME.PID.tmp`` from ``cbrun.jobs.store.files.write_file``
        stray += [
            p
            for d in (self.output_dir, self.cbrun_dir)
            for name in (JOB_FILE, STATS_FILE)
            for p in d.glob(f".{name}*.tmp")
            if p.is_file()
        ]
        for path in stray:
            path.unlink()
        return stray

    def write_empty_part_if_none(self, schema: pa.Schema) -> None:
        """Commit one part with no rows and the full ``schema`` when the output has no part (an empty job), so
        that readers of the directory find its columns."""
        if not committed_parts(self.output_dir):
            write_part_atomically(self.output_dir / part_name(0, self.lock.shard), schema.empty_table())

    def mark_finished(self, fingerprint: dict[str, Any], stats: dict[str, Any]) -> None:
        """Write job.json (when missing), stats.json, then the empty _SUCCESS marker."""
        self.prepare(fingerprint)
        self.write_finished(stats)
