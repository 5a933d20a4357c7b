"""Parquet input: ``.parquet`` files, and files of any other name that start with Parquet's magic bytes (Hive and
some Spark writers leave Parquet files without a suffix).

A file is read with ``ParquetFile.iter_batches(batch_size, columns=...)`` over only the columns the job needs, and
row groups whose rows are all done already (resume) are not read at all. An object is read in place, by ranges.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.formats import InputFormat
from cbrun.jobs.store.files import StorageError, open_input

#: Parquet files start (and end) with these 4 bytes.
PARQUET_MAGIC = b"PAR1"


class ParquetSource:
    """One Parquet file: its schema, row count and row-group offsets come from the footer alone.

    Raises:
        InputError: when the file is not a readable Parquet file.
    """

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


def _consecutive_runs(indices: list[int]) -> Iterator[list[int]]:
    run: list[int] = []
    for i in indices:
        if run and i != run[-1] + 1:
            yield run
            run = []
        run.append(i)
    if run:
        yield run


def starts_with_magic(path: Path) -> bool:
    """Whether the file starts with Parquet's magic bytes (False when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC
    except OSError:
        return False


FORMAT = InputFormat(
    name="parquet",
    title="Parquet",
    suffixes=(".parquet",),
    open_file=lambda path, options: ParquetSource(path),
    open_object=lambda uri, options: ParquetSource(uri, remote=True, endpoint_url=options.endpoint_url),
    sniff=starts_with_magic,
    field_names=lambda path: pq.read_schema(path).names,
    sniff_listing="a Parquet file of any name (e.g. Hive's 000000_0)",
    order=0,
)
