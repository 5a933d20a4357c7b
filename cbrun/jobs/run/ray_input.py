"""The job's input as a Ray Data dataset of the rows not yet committed, each row with its exact ``row_index``.

``ray.data.read_datasource(PendingRowsDatasource(...))`` gives one read task per span of pending rows (runs of rows
not committed, cut every ``cluster.batch_size`` rows, ``pending_spans``). A read task reads only the row groups its
span is in, with cbrun's sources (Parquet, JSON Lines, a ``datasets`` directory), and yields Arrow batches of the
reader's columns plus ``ROW_INDEX_COLUMN``, the row's index in the whole input: the resume key and, with the row id,
the source of its seeds. Ray Data runs the reads as tasks of their own, streamed ahead of the replicas with
backpressure, on whichever node has room.

NOTE: why a ``Datasource`` and not ``ray.data.read_parquet`` / ``read_json``: those readers give no row position.
``monotonically_increasing_id()`` is unique but not consecutive (a task id in its upper bits), ``Dataset.zip`` with
``ray.data.range`` materialises the whole input before the first row runs, and ``row_hash`` is a hash. cbrun's
resume needs each row's exact index, and skipping committed rows should skip their row groups, so the read tasks
here are cut from the done bitmap, which is the reader interface Ray Data documents for sources of its own:
https://docs.ray.io/en/latest/data/custom-datasource-example.html
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from cbrun.jobs.input.reader import InputRow

try:  # NOTE: Ray is an optional extra; without it this module still imports (``pending_spans``)
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata
except ImportError:
    Datasource = object


def pending_spans(done: np.ndarray, batch_size: int) -> list[tuple[int, int]]:
    """The rows not done as spans ``[start, end)`` of at most ``batch_size`` rows each, in row order: runs of
    consecutive rows not done, cut every ``batch_size`` rows (a span holds no done row)."""
    pending = np.flatnonzero(~done)
    if not len(pending):
        return []
    breaks = np.flatnonzero(np.diff(pending) != 1) + 1
    spans = []
    for run in np.split(pending, breaks):
        start, end = int(run[0]), int(run[-1]) + 1
        spans += [(s, min(s + batch_size, end)) for s in range(start, end, batch_size)]
    return spans


class PendingRowsDatasource(Datasource):
    """The rows of ``spans`` of the job's input, one read task per span.

    Args:
        manifest: the job (its ``[input]`` opens the reader in each read task).
        spans: ``pending_spans`` of the rows to read.
    """

    def __init__(self, manifest, spans: list[tuple[int, int]]):
        self.manifest = manifest
        self.spans = spans

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context=None
    ) -> list[ReadTask]:
        """One task per span whatever ``parallelism`` asks: a span is already one batch of a replica."""
        manifest = self.manifest
        return [
            ReadTask(
                functools.partial(_read_span, manifest, start, end),
                BlockMetadata(num_rows=end - start, size_bytes=None, input_files=None, exec_stats=None),
                per_task_row_limit=per_task_row_limit,
            )
            for start, end in self.spans
        ]

    def get_name(self) -> str:
        return "CbrunInput"


def _read_span(manifest, start: int, end: int) -> Iterator[pa.Table]:
    batches = list(_reader(manifest).read_span(start, end))
    assert sum(b.num_rows for b in batches) == end - start, (start, end)
    yield pa.Table.from_batches(batches)


_READERS: dict[str, object] = {}  # the [input] settings -> their reader, per worker process


def _reader(manifest):
    """The job's reader, opened once per worker process (its footers and schema are read once, not per span)."""
    from cbrun.jobs.run.job_setup import open_reader

    key = repr(manifest.input) + repr(manifest.output.keep_columns)
    if key not in _READERS:
        _READERS.clear()
        _READERS[key] = open_reader(manifest)
    return _READERS[key]


def input_rows(reader, batch: pa.Table) -> Iterator[InputRow]:
    """The ``InputRow`` of each row of a batch from ``PendingRowsDatasource``, with its exact row index."""
    return reader.rows_of(batch)
