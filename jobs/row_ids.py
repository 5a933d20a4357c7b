"""Repeated ``id_column`` values: harmless to resume (rows are keyed by ``row_index``), but they break a user's
join on id, so the job counts them in its summary line and names the first few in a warning before any work."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc

from jobs.reader import iter_column_batches

logger = logging.getLogger("cbrun")
#: How many repeated ids the warning names.
NUM_NAMED = 5


def repeated_ids(reader) -> tuple[int, list[tuple[str, int]]]:
    """Count the id values more than one of the reader's rows (up to ``num_rows``) holds.

    Reads only the id column, one batch at a time; memory is that of the id column's distinct values.

    Args:
        reader: a ``PromptReader`` with an ``id_column``.

    Returns:
        (number of repeated id values, the first ``NUM_NAMED`` of them with their row counts).
    """
    chunks = []
    for batch in iter_column_batches(reader.sources, reader.num_rows, [reader.id_column], reader.batch_size):
        ids = batch.column(reader.id_column)
        chunks.append(pc.cast(ids, pa.string(), safe=False) if ids.type != pa.string() else ids)
    if not chunks:
        return 0, []
    counts = pc.value_counts(pa.chunked_array(chunks, type=pa.string()).drop_null())
    repeated = pc.filter(counts, pc.greater(counts.field("counts"), 1))
    named = [(item["values"], item["counts"]) for item in repeated.slice(0, NUM_NAMED).to_pylist()]
    return len(repeated), named


def warn_repeated_ids(reader) -> int:
    """Log a warning naming the first repeated ids, if any; returns how many id values repeat."""
    try:
        num_repeated, named = repeated_ids(reader)
    except (pa.ArrowException, ValueError, TypeError):
        return 0  # NOTE: ids that cannot be read as text are the rows' own errors; nothing to count here
    if num_repeated:
        examples = ", ".join(f"{value!r} ({count} rows)" for value, count in named)
        more = f" and {num_repeated - len(named)} more" if num_repeated > len(named) else ""
        logger.warning("input.id_column %r repeats values: %s%s; rows are keyed by row_index, so resume is "
                       "unaffected, but a join on id matches several rows", reader.id_column, examples, more)
    return num_repeated
