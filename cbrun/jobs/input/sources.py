"""The sources of one input's files: each gives its ``path``, ``schema``, ``num_rows`` and record batches.

A Parquet file is read with ``ParquetFile.iter_batches(batch_size, columns=...)`` over only the columns the job needs,
and row groups whose rows are all done already (resume) are not read at all. A ``datasets`` data set's Arrow stream
files are memory-mapped; JSON Lines files are ``cbrun.jobs.input.jsonl_source.JsonlSource``. ``open_source`` picks one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.jobs.input.discovery import input_file_format, object_file_format
from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.jsonl_source import JsonlSource
from cbrun.jobs.store.cache import local_copy
from cbrun.jobs.store.files import StorageError, open_input


class _ParquetSource:
    """One Parquet file: its schema, row count and row-group offsets come from the footer alone."""

    def __init__(self, path: Path | str, remote: bool = False, endpoint_url: str | None = None):
        self.path = path
        try:
            # NOTE: an object is read by ranges through fsspec; a local file by pyarrow's own (memory-mapped) reads
            self.file = pq.ParquetFile(open_input(path, endpoint_url) if remote else path)
        except (pa.ArrowInvalid, OSError, StorageError) as exc:
            raise InputError(f"input file {str(path)!r} is not a readable Parquet file: {exc}") from None
        self.schema = self.file.schema_arrow
        metadata = self.file.metadata
        self.row_group_sizes = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        self.num_rows = metadata.num_rows

    def iter_batches(
        self, columns: list[str], batch_size: int, first_row: int, skip: np.ndarray | None
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        """Yield (row index of the batch's first row, batch), not reading row groups whose rows are all in ``skip``.

        Args:
            first_row: the global row index of this file's first row.
            skip: bool array over this file's rows, True where the row needs no reading; None reads all.
        """
        offsets = np.cumsum([0] + self.row_group_sizes)
        wanted = [
            g for g in range(len(self.row_group_sizes)) if skip is None or not skip[offsets[g] : offsets[g + 1]].all()
        ]
        # NOTE: consecutive wanted row groups are read as one run so batches keep their full size; the run's first
        # row fixes the row index of every batch in it.
        for run in _consecutive_runs(wanted):
            row = first_row + int(offsets[run[0]])
            for batch in self.file.iter_batches(batch_size=batch_size, row_groups=run, columns=columns):
                yield row, batch
                row += batch.num_rows


class _ArrowStreamSource:
    """One Arrow IPC stream file of a ``datasets`` data set saved with ``save_to_disk``, memory-mapped."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with pa.ipc.open_stream(pa.memory_map(str(path))) as reader:
                self.schema = reader.schema
                self.num_rows = sum(batch.num_rows for batch in reader)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"input file {str(path)!r} is not a readable Arrow stream: {exc}") from None

    def iter_batches(
        self, columns: list[str], batch_size: int, first_row: int, skip: np.ndarray | None
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        row = first_row
        with pa.ipc.open_stream(pa.memory_map(str(self.path))) as reader:
            for stored in reader:
                for start in range(0, stored.num_rows, batch_size):
                    batch = stored.slice(start, batch_size)
                    local = row - first_row
                    if skip is None or not skip[local : local + batch.num_rows].all():
                        yield row, batch.select(columns)
                    row += batch.num_rows


def open_source(kind: str, path: Path, json_text_fields: tuple[str, ...] = (), endpoint_url: str | None = None):
    """The source object of one input file of ``kind`` (``list_input_files``): Arrow stream, JSON Lines (by suffix)
    or Parquet, local or an object (``endpoint_url``: its S3 endpoint)."""
    if kind == "arrow":
        return _ArrowStreamSource(path)
    if kind == "objects":
        if object_file_format(str(path)) == "jsonl":
            # NOTE: JSON Lines is read by line offsets from a local file: the object is copied to a temporary file
            return JsonlSource(local_copy(str(path), endpoint_url), json_text_fields)
        return _ParquetSource(path, remote=True, endpoint_url=endpoint_url)
    if input_file_format(path) == "jsonl":
        return JsonlSource(path, json_text_fields)
    return _ParquetSource(path)


def iter_column_batches(sources, num_rows: int, columns: list[str], batch_size: int) -> Iterator[pa.RecordBatch]:
    """Batches of ``columns`` over the input's first ``num_rows`` rows (a ``limit`` cuts the last file short),
    file after file; rows past ``num_rows`` are never yielded."""
    first_row = 0
    for source in sources:
        end = min(source.num_rows, num_rows - first_row)
        if end <= 0:
            break
        skip = np.zeros(source.num_rows, dtype=bool)
        skip[end:] = True
        for row, batch in source.iter_batches(columns, batch_size, first_row, skip):
            yield batch.slice(0, min(batch.num_rows, first_row + end - row))
        first_row += source.num_rows


def _consecutive_runs(indices: list[int]) -> Iterator[list[int]]:
    run: list[int] = []
    for i in indices:
        if run and i != run[-1] + 1:
            yield run
            run = []
        run.append(i)
    if run:
        yield run
