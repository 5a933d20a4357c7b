"""The parts of an object-store output (``ObjectParts``, the ``PartLog`` of ``cbrun.jobs.output.output_dir.OutputDir``):
``s3://``, ``gs://`` have no rename, so a part counts once its commit record exists (``cbrun.jobs.output.commits``)::

    OUT/part-<attempt>-<seq>-r<first row>.parquet   a part (counts once its record exists)
    OUT/_cbrun/commits/<part>.json                  a part's commit record: its rows and error rows, packed bits
    OUT/_cbrun/lease-0-of-1.json                    the run's lease (``cbrun.jobs.output.lease``)

Which rows are done is read from the commit records alone; parts without a record are deleted by ``open``. A row
found in two records (only after a lease was taken from a run that kept writing, see ``cbrun.jobs.output.lease``)
keeps its copy in the earliest part (by name: attempts sort by start time); ``open`` rewrites the later parts
without it.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

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
from cbrun.jobs.output.lease import Lease, read_holder
from cbrun.jobs.output.lock import CBRUN_DIR, Shard
from cbrun.jobs.output.part_log import OutputState, groups_by_size
from cbrun.jobs.output.writer import PartWriter, _Batch, conform_table, read_parts, rows_to_table
from cbrun.jobs.store.store import FsspecStore

logger = logging.getLogger("cbrun")


class ObjectParts:
    """The committed parts of an object-store output (those with a commit record): read, rewritten, cleared,
    compacted; its lease per shard.

    Args:
        store: the output prefix's ``FsspecStore``.
    """

    what = "commit records"

    def __init__(self, store: FsspecStore) -> None:
        self.store = store
        self.output_dir = store.root

    def lock(self, shard: Shard) -> Lease:
        return Lease(self.store, shard)

    def records(self) -> list[CommitRecord]:
        """Every commit record, in part-name order (the order the parts were written)."""
        return read_records(self.store)

    def has_parts(self) -> bool:
        return bool(self.records())

    def num_parts(self) -> int:
        return len(self.records())

    def part_files(self) -> Iterator[Any]:
        """The committed parts, each opened when it is reached, in the order they were written."""
        for record in self.records():
            yield self.store.open(record.part)

    def remove_stray(self, shard: Shard) -> None:
        pass  # NOTE: an object appears whole or not at all: nothing is half-written

    def recover(self) -> int:
        """Delete the parts without a commit record, then keep each row in its earliest part (one read of the
        records for both)."""
        records = self.records()
        self._remove_unrecorded({r.part for r in records})
        return self.remove_duplicates(records)

    def _remove_unrecorded(self, committed: set[str]) -> None:
        """Delete the parts that have no commit record (a run killed between its part and its record)."""
        garbage = [name for name in self.store.list() if OBJECT_PART_RE.match(name) and name not in committed]
        for name in garbage:
            self.store.delete(name)
        if garbage:
            logger.info("cbrun: deleted %d uncommitted parts of %s", len(garbage), self.output_dir)

    def read_state(self, num_rows: int, within: np.ndarray | None = None) -> OutputState:
        """The done bitmap and error counts of rows 0..num_rows-1, from the commit records."""
        done = np.zeros(num_rows, dtype=bool)
        failed = np.zeros(num_rows, dtype=bool)
        num_output_rows = num_error_rows = 0
        for record in self.records():
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
        with self.store.open(record.part) as f:
            table = pq.read_table(f, columns=["row_index", "finish_reason"])
        indices = table.column("row_index").to_numpy()
        keep = indices < num_rows
        if within is not None:
            keep[keep] = within[indices[keep]]
        return table.filter(pa.array(keep))

    def remove_duplicates(self, records: list[CommitRecord] | None = None) -> int:
        """Keep each row in its earliest part only, rewriting later parts without it; returns copies removed."""
        records = self.records() if records is None else records
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
        with self.store.open(record.part) as f:
            table = conform_table(pq.read_table(f))
        drop = pc.is_in(table.column("row_index"), value_set=pa.array(row_indices, pa.int64()))
        kept = table.filter(pc.invert(drop))
        if kept.num_rows:
            ObjectPartWriter(self.store, schema=kept.schema).commit_table(kept)
        self._remove_committed(record)
        return table.num_rows - kept.num_rows

    def _remove_committed(self, record: CommitRecord) -> None:
        """The record first (the part stops counting), then the part."""
        self.store.delete(record.name or record_name(record.part))
        self.store.delete(record.part)

    def writer(
        self, commit_every_rows: int, commit_every_seconds: float, carried_fields: Sequence[pa.Field], lock
    ) -> ObjectPartWriter:
        return ObjectPartWriter(
            self.store, commit_every_rows, commit_every_seconds, carried_fields=carried_fields, lease=lock
        )

    def clear(self) -> None:
        """Delete every part and commit record of the output."""
        for name in self.store.list():
            if OBJECT_PART_RE.match(name) or name.startswith(COMMITS_DIR + "/"):
                self.store.delete(name)

    def write_empty_part(self, schema: pa.Schema, shard: Shard) -> None:
        ObjectPartWriter(self.store, schema=schema).commit_table(schema.empty_table())

    def settle(self) -> None:
        # NOTE: a Ray span retried under another batching commits its rows twice; the finished job holds them once
        self.remove_duplicates()

    def held_locks(self) -> dict[str, dict]:
        """{"I/N": holder record} of the unexpired leases on this output."""
        held = {}
        for name in self.store.list(CBRUN_DIR):
            base = name.rsplit("/", 1)[-1]
            if base.startswith("lease-") and (record := read_holder(self.store, name)).get("expires", 0) > time.time():
                index, _, count = base.removeprefix("lease-").removesuffix(".json").partition("-of-")
                held[f"{index}/{count}"] = record
        return held

    def compact(self, shards: list[Shard], target_bytes: int) -> tuple[int, int, int]:
        """Merge parts into parts of about ``target_bytes``: each merged part and its record first, then the old
        records (the old parts stop counting), then the old parts."""
        records = self.records()
        sizes = [int((self.store.info(r.part) or {}).get("size") or 0) for r in records]
        writer = ObjectPartWriter(self.store)
        groups = groups_by_size(sizes, target_bytes)
        for group in groups:
            merged = [records[i] for i in group]
            writer.commit_table(read_parts(self.store.open(r.part) for r in merged))
            for record in merged:
                self.store.delete(record.name)
            for record in merged:
                self.store.delete(record.part)
        return len(records), len(records) - sum(len(g) for g in groups) + len(groups), len(groups)


class ObjectPartWriter(PartWriter):
    """``PartWriter`` for an object-store output: each commit PUTs a part under this attempt's unique name, then
    its commit record (both create-only); the part counts from the record on.

    A commit interrupted at any line can be run again: the part or record already written is found by its
    create-only PUT and not written twice; the batch is replaced at the last line, as in ``PartWriter.commit``.

    Args:
        store: the output's store.
        schema: the parts' schema (``OUTPUT_SCHEMA`` plus ``carried_fields``) when given.
        lease: the run's lease, checked before each commit (a run that lost it stops: ``cbrun.jobs.output.lease.LeaseLost``).
        (the others: ``PartWriter``'s).
    """

    def __init__(
        self,
        store: FsspecStore,
        commit_every_rows: int = 1000,
        commit_every_seconds: float = 30.0,
        carried_fields: Sequence[pa.Field] = (),
        schema: pa.Schema | None = None,
        lease: Lease | None = None,
    ):
        super().__init__(store.root, commit_every_rows, commit_every_seconds, carried_fields)
        self.store = store
        self.output_dir = store.root
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
        record = _put_part(self.store, table, self.attempt, seq)
        _put_once(self.store, record_name(record.part), record.to_json())
        return self.store.path(record.part)


def _put_part(store: FsspecStore, table: pa.Table, attempt: str, seq: int) -> CommitRecord:
    """PUT ``table`` as this attempt's part ``seq`` (create-only); returns the commit record that would count it."""
    indices = table.column("row_index").to_numpy()
    is_error = pc.fill_null(pc.equal(table.column("finish_reason"), "error"), False).to_numpy(zero_copy_only=False)
    name = object_part_name(attempt, seq, int(indices.min()) if len(indices) else 0)
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    _put_once(store, name, buffer.getvalue())
    return CommitRecord.of_rows(name, indices, is_error)


def _put_once(store: FsspecStore, name: str, body: bytes) -> None:
    """A create-only PUT; an object already there under this attempt's unique name is this commit's own, from a
    try that was interrupted after its PUT."""
    store.put_if_absent(name, body)


def commit_span(store: FsspecStore, table: pa.Table, attempt: str, seq: int) -> bool:
    """Commit a Ray replica's output table of one span: its part under this attempt's name, then the span's
    record (``span_record_name``), create-only. Returns whether this attempt's record won; a part that lost is
    deleted (an earlier attempt at the span committed the same rows).

    Raises:
        StorageError: when the store failed after its retries (Ray retries the batch).
    """
    record = _put_part(store, table, attempt, seq)
    name = span_record_name(record.first_row, record.end_row)
    if store.put_if_absent(name, record.to_json()):
        return True
    winner = store.read(name)
    if winner is not None and CommitRecord.from_json(winner).part == record.part:
        return True  # NOTE: this attempt's own record, from a try whose reply was lost
    store.delete(record.part)
    return False
