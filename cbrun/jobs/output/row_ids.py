"""Repeated ``id_column`` values: harmless to resume (rows are keyed by ``row_index``), but they break a user's
join on id, so the job counts them in its summary line and names the first few in a warning before any work.

Counting reads the whole id column, so its result is kept in ``_cbrun/repeated-ids.json`` with the input's
fingerprint: the shards of a sharded run and later reruns (resume) read it instead of the column, and concurrent
shards take turns (``DirectoryLock``) so the first counts and the others read. A changed input has another
fingerprint and is counted again.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from cbrun.jobs.input.sources import iter_column_batches
from cbrun.jobs.output.lock import DirectoryLock
from cbrun.jobs.output.output_dir import open_output

logger = logging.getLogger("cbrun")
#: How many repeated ids the warning names.
NUM_NAMED = 5
REPEATED_IDS_FILE = "repeated-ids.json"


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


def recorded_repeated_ids(reader, output_dir: str | Path, input_fingerprint: dict) -> tuple[int, list]:
    """``repeated_ids(reader)``, read from ``_cbrun/repeated-ids.json`` when a run of the same input (its
    fingerprint and ``num_rows``) recorded it, else counted and recorded there (atomically)."""
    owner = open_output(output_dir)
    key = {"input": input_fingerprint, "num_rows": reader.num_rows}
    with DirectoryLock(output_dir):
        try:
            recorded = owner.read_meta(REPEATED_IDS_FILE)
            if recorded["key"] == key:
                return recorded["num_repeated"], [tuple(item) for item in recorded["named"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet (or unreadable): count
        num_repeated, named = repeated_ids(reader)
        owner.write_meta(REPEATED_IDS_FILE, {"key": key, "num_repeated": num_repeated, "named": named})
    return num_repeated, named


def warn_repeated_ids(reader, output_dir: str | Path | None = None, input_fingerprint: dict | None = None) -> int:
    """Log a warning naming the first repeated ids, if any; returns how many id values repeat.

    Args:
        reader: a ``PromptReader`` with an ``id_column``.
        output_dir, input_fingerprint: the job's output and ``job_fingerprint(...)["input"]``: the count is read
            from (or recorded in) the output (``recorded_repeated_ids``); None counts without recording.
    """
    try:
        if output_dir is None:
            num_repeated, named = repeated_ids(reader)
        else:
            num_repeated, named = recorded_repeated_ids(reader, output_dir, input_fingerprint)
    except (pa.ArrowException, ValueError, TypeError):
        return 0  # NOTE: ids that cannot be read as text are the rows' own errors; nothing to count here
    if num_repeated:
        examples = ", ".join(f"{value!r} ({count} rows)" for value, count in named)
        more = f" and {num_repeated - len(named)} more" if num_repeated > len(named) else ""
        logger.warning(
            "input.id_column %r repeats values: %s%s; rows are keyed by row_index, so resume is "
            "unaffected, but a join on id matches several rows",
            reader.id_column,
            examples,
            more,
        )
    return num_repeated
