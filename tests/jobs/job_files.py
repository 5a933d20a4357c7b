"""The files of a job test: an input table of ``id`` and ``prompt`` columns, and the output rows read back."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.jobs.output.output_dir import read_output


def write_prompts(path, num_rows: int, prompt: str = "a prompt for row {i}", **extra):
    """Write a Parquet table of ``num_rows`` rows to ``path``: ``id`` ("r0", "r1", ...), ``prompt`` (``prompt``
    formatted with the row's index ``i``) and the ``extra`` columns; returns ``path``."""
    ids = [f"r{i}" for i in range(num_rows)]
    pq.write_table(pa.table({"id": ids, "prompt": [prompt.format(i=i) for i in range(num_rows)], **extra}), path)
    return path


def rows_once(output_dir) -> dict[tuple[int, int], dict]:
    """{(row_index, sample_index): row} of a local or remote output, asserting that no output row appears twice."""
    rows = read_output(output_dir).to_pylist()
    by_key = {(r["row_index"], r["sample_index"]): r for r in rows}
    assert len(by_key) == len(rows), "an output row was committed twice"
    return by_key


def sorted_rows(output_dir) -> list[dict]:
    """The output rows in (row_index, sample_index) order, every one once."""
    by_key = rows_once(output_dir)
    return [by_key[k] for k in sorted(by_key)]
