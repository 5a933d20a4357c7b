"""The sources of one input's files: each gives its ``path``, ``schema``, ``num_rows`` and record batches
(``cbrun.jobs.input.formats.InputSource``).

``open_source`` opens a file by its format (``cbrun.jobs.input.formats``: Parquet, JSON Lines); a ``datasets`` data
set's Arrow stream files, a layout rather than a file format, are memory-mapped here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from cbrun.jobs.input.discovery import input_file_format, object_file_format
from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.formats import InputSource, OpenOptions, supported_inputs
from cbrun.jobs.store.cache import local_copy


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


def open_source(
    kind: str, path: Path | str, json_text_fields: tuple[str, ...] = (), endpoint_url: str | None = None
) -> InputSource:
    """The source of one input file of ``kind`` (``list_input_files``): an Arrow stream file of a saved data set, or
    a local file or object opened by its format (``cbrun.jobs.input.formats``; ``endpoint_url``: the object's S3
    endpoint).

    Raises:
        InputError: when the file does not read as its format.
    """
    if kind == "arrow":
        return _ArrowStreamSource(Path(path))
    options = OpenOptions(json_text_fields, endpoint_url)
    fmt = object_file_format(str(path)) if kind == "objects" else input_file_format(Path(path))
    if fmt is None:  # NOTE: listed as readable; only a file changed since can get here
        raise InputError(f"input file {str(path)!r} is not a format cbrun reads; cbrun reads {supported_inputs()}")
    if kind != "objects":
        return fmt.open_file(Path(path), options)
    if fmt.open_object is None:
        # NOTE: a format that reads local files only: the object is copied to a temporary file first
        return fmt.open_file(local_copy(str(path), endpoint_url), options)
    return fmt.open_object(str(path), options)


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
