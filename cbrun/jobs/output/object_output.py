"""The owner of an object-store output (``s3://``, ``gs://``): lease, fingerprint, committed rows, finished marker.

It offers what ``cbrun.jobs.output.checkpoint.Checkpoint`` offers a local directory, over the rename-free commit protocol of
``cbrun.jobs.output.commits``::

    OUT/part-<attempt>-<seq>-r<first row>.parquet   a part (counts once its record exists)
    OUT/_SUCCESS                                    the job finished (written last)
    OUT/_cbrun/job.json                             the job's fingerprint (``cbrun.jobs.output.fingerprint``)
    OUT/_cbrun/stats.json                           the last run's summary, once the job finished
    OUT/_cbrun/commits/<part>.json                  a part's commit record: its rows and error rows, packed bits
    OUT/_cbrun/lease-0-of-1.json                    the run's lease (``cbrun.jobs.output.lease``)

Which rows are done is read from the commit records alone; parts without a record are deleted by ``open``. A row
found in two records (only after a lease was taken from a run that kept writing, see ``cbrun.jobs.output.lease``) keeps its
copy in the earliest part (by name: attempts sort by start time); ``open`` rewrites the later parts without it.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cbrun.jobs.output.checkpoint import (
    JOB_FILE,
    STATS_FILE,
    SUCCESS_FILE,
    Checkpoint,
    FingerprintMismatch,
    OutputState,
)
from cbrun.jobs.output.commits import (
    COMMITS_DIR,
    OBJECT_PART_RE,
    CommitRecord,
    add_span,
    new_attempt,
    object_part_name,
    read_records,
    record_name,
    span_record_name,
)
from cbrun.jobs.output.fingerprint import fingerprint_differences
from cbrun.jobs.output.lease import Lease, read_holder
from cbrun.jobs.output.lock import CBRUN_DIR, Shard
from cbrun.jobs.output.output_dir import OutputDir
from cbrun.jobs.output.writer import PartWriter, _Batch, conform_table, rows_to_table
from cbrun.jobs.store.files import (
    PreconditionFailed,
    is_uri,
    join,
    list_files,
    local_path,
    open_input,
    put_object,
    read_file,
    remove,
)
from cbrun.jobs.store.store import FsspecStore

logger = logging.getLogger("cbrun")


class ObjectCheckpoint(OutputDir):
    """The one owner of an object-store output: lease, fingerprint, commit records, finished marker, appender.

    Args:
        output: the output URI (``s3://bucket/prefix``).
        shard: this process's share of the output.
        endpoint_url: the S3 endpoint its store talks to (None: the process's, else the environment's).
    """

    def __init__(self, output: str, shard: Shard = Shard(), endpoint_url: str | None = None):
        self.output_dir = output.rstrip("/")
        super().__init__(FsspecStore(self.output_dir, endpoint_url), None)
        self.cbrun_dir = str(join(self.output_dir, CBRUN_DIR))
        self.lock = Lease(self.output_dir, shard)

    @property
    def job_file(self) -> str:
        return str(join(self.cbrun_dir, JOB_FILE))

    def _name(self, uri: str) -> str:
        return uri[len(self.output_dir) + 1 :]

    def records(self) -> list[CommitRecord]:
        """Every commit record, in part-name order (the order the parts were written)."""
        return read_records(self.output_dir)

    def committed_parts(self) -> list[str]:
        """The URIs of the committed parts, in the order they were written."""
        return [str(join(self.output_dir, r.part)) for r in self.records()]

    def check(self, fingerprint: dict[str, Any], *, overwrite: bool = False) -> None:
        """Make sure the output may take this job; touches nothing.

        Raises:
            FingerprintMismatch: when job.json holds another fingerprint and ``overwrite`` is false.
        """
        old = None if overwrite else self.read_job_file()
        if old is not None and (changed := fingerprint_differences(old, fingerprint)):
            raise FingerprintMismatch(
                f"output {self.output_dir!r} holds the results of a different job (changed: {', '.join(changed)}); "
                f"rerun with --overwrite to discard them, or choose another --output"
            )

    def open(
        self, fingerprint: dict[str, Any], num_rows: int, *, overwrite: bool = False, retry_errors: bool = False
    ) -> OutputState:
        """Check the output, delete uncommitted parts, and read which rows are done (``Checkpoint.open``)."""
        assert self.lock.held, "open the output under its lease"
        self.check(fingerprint, overwrite=overwrite)
        if overwrite:
            return OutputState(done=np.zeros(num_rows, dtype=bool))
        records = self.records()
        if self.read_job_file() is None and records:
            raise FingerprintMismatch(
                f"output {self.output_dir!r} holds commit records but no _cbrun/job.json; "
                f"rerun with --overwrite to discard them, or choose another --output"
            )
        self.remove_garbage({r.part for r in records})
        num_duplicates = self.remove_duplicates(records)
        state = self.read_state(num_rows)
        state.num_duplicates = num_duplicates
        if retry_errors and len(state.error_rows):
            self.clear_finished()
            self.remove_rows(state.error_rows)
            state = self.read_state(num_rows)
        return state

    def remove_garbage(self, committed: set[str]) -> list[str]:
        """Delete the parts that have no commit record (a run killed between its part and its record)."""
        garbage = [
            uri
            for uri in list_files(self.output_dir)
            if "/" not in self._name(uri) and OBJECT_PART_RE.match(self._name(uri)) and self._name(uri) not in committed
        ]
        for uri in garbage:
            remove(uri)
        if garbage:
            logger.info("cbrun: deleted %d uncommitted parts of %s", len(garbage), self.output_dir)
        return garbage

    def read_state(
        self, num_rows: int, within: np.ndarray | None = None, records: list[CommitRecord] | None = None
    ) -> OutputState:
        """The done bitmap and error counts of rows 0..num_rows-1, from the commit records."""
        done = np.zeros(num_rows, dtype=bool)
        failed = np.zeros(num_rows, dtype=bool)
        num_output_rows = num_error_rows = 0
        for record in self.records() if records is None else records:
            add_span(done, record, record.done, within)
            add_span(failed, record, record.errors, within)
            # NOTE: the counts are the part's; rows past num_rows (a larger earlier limit) are rare: counted exactly
            if record.end_row <= num_rows and within is None:
                num_output_rows += record.num_output_rows
                num_error_rows += record.num_error_rows
            else:
                table = self._read_rows(record, within, num_rows)
                num_output_rows += table.num_rows
                num_error_rows += int(pc.sum(pc.equal(table.column("finish_reason"), "error")).as_py() or 0)
        return OutputState(done, np.flatnonzero(failed), num_output_rows, num_error_rows)

    def _read_rows(self, record: CommitRecord, within: np.ndarray | None, num_rows: int) -> pa.Table:
        with open_input(join(self.output_dir, record.part)) as f:
            table = pq.read_table(f, columns=["row_index", "finish_reason"])
        indices = table.column("row_index").to_numpy()
        keep = indices < num_rows
        if within is not None:
            keep[keep] = within[indices[keep]]
        return table.filter(pa.array(keep))

    def done_rows(self, num_rows: int) -> np.ndarray:
        return self.read_state(num_rows).done

    def remove_duplicates(self, records: list[CommitRecord]) -> int:
        """Keep each row in its earliest part only, rewriting later parts without it; returns copies removed."""
        seen = np.zeros(max((r.end_row for r in records), default=0), dtype=bool)
        removed = 0
        for record in records:
            rows = record.rows()
            repeated = rows[seen[rows]]
            seen[rows] = True
            if len(repeated):
                removed += self._rewrite_without(record, repeated)
        if removed:
            logger.warning(
                "cbrun: %s held %d output rows written twice (a run that kept writing after its lease "
                "was taken over); kept each row's earliest copy",
                self.output_dir,
                removed,
            )
        return removed

    def remove_rows(self, row_indices: np.ndarray) -> int:
        """Take rows (all their output rows) out of the committed parts; returns the output rows removed."""
        return sum(
            self._rewrite_without(r, row_indices) for r in self.records() if np.isin(r.rows(), row_indices).any()
        )

    def _rewrite_without(self, record: CommitRecord, row_indices: np.ndarray) -> int:
        """Replace a part by one without the given rows: the new part and its record first, then the old record,
        then the old part (a kill between leaves rows in two records; the next open removes the later copy)."""
        with open_input(join(self.output_dir, record.part)) as f:
            table = conform_table(pq.read_table(f))
        drop = pc.is_in(table.column("row_index"), value_set=pa.array(row_indices, pa.int64()))
        kept = table.filter(pc.invert(drop))
        if kept.num_rows:
            writer = ObjectPartWriter(self.output_dir, schema=kept.schema)
            writer.commit_table(kept)
        remove(str(join(self.output_dir, record.name or record_name(record.part))))
        remove(str(join(self.output_dir, record.part)))
        return table.num_rows - kept.num_rows

    def start(
        self,
        fingerprint: dict[str, Any],
        commit_every_rows: int,
        commit_every_seconds: float,
        *,
        overwrite: bool = False,
        carried_fields: Sequence[pa.Field] = (),
    ) -> ObjectPartWriter:
        """Make the output ready to take rows; returns its appender (``Checkpoint.start``)."""
        self.prepare(fingerprint, overwrite=overwrite)
        self.clear_finished()
        return ObjectPartWriter(
            self.output_dir, commit_every_rows, commit_every_seconds, carried_fields=carried_fields, lease=self.lock
        )

    def prepare(self, fingerprint: dict[str, Any], *, overwrite: bool = False) -> None:
        """Check, clear when ``overwrite``, write job.json when it differs."""
        self.check(fingerprint, overwrite=overwrite)
        if overwrite:
            self.clear()
        if self.read_job_file() != fingerprint:
            self.write_job_file(fingerprint)

    def clear(self) -> None:
        """Delete every cbrun object of the output (parts, records, job files); the lease stays."""
        for uri in list_files(self.output_dir):
            name = self._name(uri)
            if (
                OBJECT_PART_RE.match(name)
                or name.startswith(COMMITS_DIR + "/")
                or name == SUCCESS_FILE
                or name in (f"{CBRUN_DIR}/{JOB_FILE}", f"{CBRUN_DIR}/{STATS_FILE}", f"{CBRUN_DIR}/shards.json")
            ):
                remove(uri)

    def write_empty_part_if_none(self, schema: pa.Schema) -> None:
        """Commit one part with no rows and the full ``schema`` when the output has none (an empty job)."""
        if not self.records():
            ObjectPartWriter(self.output_dir, schema=schema).commit_table(schema.empty_table())

    def mark_finished(self, fingerprint: dict[str, Any], stats: dict[str, Any]) -> None:
        """Write job.json (when it differs), stats.json, then the empty _SUCCESS marker."""
        self.prepare(fingerprint)
        # NOTE: a Ray span retried under another batching commits its rows twice; the finished job holds them once
        self.remove_duplicates(self.records())
        self.write_finished(stats)

    def held_locks(self) -> dict[str, dict]:
        """{"I/N": holder record} of the unexpired leases on this output."""
        import time

        held = {}
        for uri in list_files(self.cbrun_dir):
            name = uri.rsplit("/", 1)[-1]
            if name.startswith("lease-") and (record := read_holder(uri)).get("expires", 0) > time.time():
                index, _, count = name.removeprefix("lease-").removesuffix(".json").partition("-of-")
                held[f"{index}/{count}"] = record
        return held


class ObjectPartWriter(PartWriter):
    """``PartWriter`` for an object-store output: each commit PUTs a part under this attempt's unique name, then
    its commit record (both create-only); the part counts from the record on.

    A commit interrupted at any line can be run again: the part or record already written is found by its
    create-only PUT and not written twice; the batch is replaced at the last line, as in ``PartWriter.commit``.

    Args:
        output: the output URI.
        schema: the parts' schema (``OUTPUT_SCHEMA`` plus ``carried_fields``) when given.
        lease: the run's lease, checked before each commit (a run that lost it stops: ``cbrun.jobs.output.lease.LeaseLost``).
        (the others: ``PartWriter``'s).
    """

    def __init__(
        self,
        output: str,
        commit_every_rows: int = 1000,
        commit_every_seconds: float = 30.0,
        carried_fields: Sequence[pa.Field] = (),
        schema: pa.Schema | None = None,
        lease: Lease | None = None,
    ):
        super().__init__(output, commit_every_rows, commit_every_seconds, carried_fields)
        self.output_dir = output.rstrip("/")
        if schema is not None:
            self.schema = schema
        self.attempt = new_attempt()
        self.lease = lease

    def _first_part_number(self) -> int:
        return 0  # NOTE: the attempt's own tag keeps its names apart from every other run's

    def commit(self) -> str | None:
        """Write every buffered row as the next part and commit it; returns its URI (None when nothing is
        buffered)."""
        batch = self._batch
        if not batch.rows:
            return None
        uri = self._commit(rows_to_table(batch.rows, self.schema), batch.number)
        self._batch = _Batch(batch.number + 1, num_committed_rows=batch.num_committed_rows + len(batch.rows))
        return uri

    def commit_table(self, table: pa.Table) -> str:
        """Commit a whole table as one part now (a rewrite or a compaction's output)."""
        uri = self._commit(table, self._batch.number)
        self._batch = _Batch(self._batch.number + 1, num_committed_rows=self._batch.num_committed_rows)
        return uri

    def _commit(self, table: pa.Table, seq: int) -> str:
        if self.lease is not None:
            self.lease.check()
        indices = table.column("row_index").to_numpy()
        is_error = pc.fill_null(pc.equal(table.column("finish_reason"), "error"), False).to_numpy(zero_copy_only=False)
        name = object_part_name(self.attempt, seq, int(indices.min()) if len(indices) else 0)
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        uri = str(join(self.output_dir, name))
        _put_once(uri, buffer.getvalue())
        _put_once(
            str(join(self.output_dir, record_name(name))), CommitRecord.of_rows(name, indices, is_error).to_json()
        )
        return uri


def _put_once(uri: str, body: bytes) -> None:
    """A create-only PUT; an object already there under this attempt's unique name is this commit's own, from a
    try that was interrupted after its PUT."""
    try:
        put_object(uri, body, create_only=True)
    except PreconditionFailed:
        pass


def output_owner(
    output: str | Path, shard: Shard = Shard(), endpoint_url: str | None = None
) -> Checkpoint | ObjectCheckpoint:
    """The owner of an output: ``ObjectCheckpoint`` for an object-store URI (its store talks to ``endpoint_url``),
    ``Checkpoint`` for a local path."""
    if is_uri(output):
        return ObjectCheckpoint(str(output), shard, endpoint_url)
    return Checkpoint(local_path(output), shard)


def commit_span(output: str, table: pa.Table, attempt: str, seq: int) -> bool:
    """Commit a Ray replica's output table of one span: its part under this attempt's name, then the span's
    record (``span_record_name``), create-only. Returns whether this attempt's record won; a part that lost is
    deleted (an earlier attempt at the span committed the same rows).

    Raises:
        StorageError: when the store failed after its retries (Ray retries the batch).
    """
    indices = table.column("row_index").to_numpy()
    is_error = pc.fill_null(pc.equal(table.column("finish_reason"), "error"), False).to_numpy(zero_copy_only=False)
    name = object_part_name(attempt, seq, int(indices.min()))
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    _put_once(str(join(output, name)), buffer.getvalue())
    record = CommitRecord.of_rows(name, indices, is_error)
    record_uri = str(join(output, span_record_name(record.first_row, record.end_row)))
    try:
        put_object(record_uri, record.to_json(), create_only=True)
        return True
    except PreconditionFailed:
        winner = read_file(record_uri)
        if winner is not None and CommitRecord.from_json(winner).part == name:
            return True  # NOTE: this attempt's own record, from a try whose reply was lost
        remove(str(join(output, name)))
        return False
