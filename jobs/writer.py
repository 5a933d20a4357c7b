"""Commit finished rows to ``part-NNNNNN.parquet`` files, atomically.

Each part is written under a hidden temporary name, flushed, fsynced, then ``os.replace``d to its final name (and
the directory fsynced), so whoever lists the directory sees whole parts or nothing. A kill loses only the rows
buffered since the last commit; resume recomputes them::

    finished rows --> buffer --(commit_every_rows or commit_every_seconds)--> .part-000007.parquet.tmp
                                                                                   | flush, fsync, os.replace
                                                                                   v
                                                                             part-000007.parquet
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
TEMP_RE = re.compile(r"^\.part-(\d{6,})\.parquet\.tmp$")

#: The one schema of every part file.
OUTPUT_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("row_index", pa.int64(), nullable=False),
    pa.field("completion", pa.string()),
    pa.field("completion_token_ids", pa.list_(pa.int32())),
    pa.field("num_prompt_tokens", pa.int64(), nullable=False),
    # Generation columns: null in score mode (nothing is generated; finish_reason "error" on an error row).
    pa.field("num_completion_tokens", pa.int64()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
    # Null unless the job asks for them (sampling.logprobs; sampling.prompt_logprobs = true or prompt_logprobs_from):
    # prompt_logprobs[i] is the log-probability of prompt token prompt_logprobs_from + i (from 1: all but the first).
    pa.field("logprobs", pa.list_(pa.map_(pa.int32(), pa.float32()))),
    pa.field("prompt_logprobs", pa.list_(pa.float32())),
    pa.field("prompt_greedy", pa.list_(pa.bool_())),
    # What ended a "stop" row: the stop string, or the stop (or EOS) token id as text; null otherwise.
    pa.field("stop_reason", pa.string()),
    # Score mode (input.mode = "score") only, one entry per candidate; null in generate mode (see jobs.scoring):
    pa.field("candidate_logprobs", pa.list_(pa.float64())),
    pa.field("candidate_num_tokens", pa.list_(pa.int32())),
    pa.field("candidate_is_greedy", pa.list_(pa.bool_())),
    # Which of the row's samples this is (sampling.n or the row's n column): 0 .. n-1; 0 for one sample per row.
    pa.field("sample_index", pa.int32(), nullable=False),
])

FINISH_REASONS = ("stop", "length", "error")


@dataclass
class OutputRow:
    """One finished row as stored: a completion, or an error (``finish_reason == "error"``, ``completion`` null).
    A score-mode row has its candidates' columns instead, and null generation columns.

    ``logprobs`` (per generated token, {token id: log-probability}), ``prompt_logprobs`` and ``prompt_greedy`` are
    None unless the job's sampling settings ask for them. ``stop_reason`` says which stop string or token id ended
    a "stop" row. The ``candidate_*`` lists are score mode's (one entry per candidate), None in generate mode.
    A row with ``n`` samples is stored as ``n`` output rows of the same ``id`` and ``row_index``, ``sample_index``
    0 .. n-1. ``carried`` holds the values of the input columns the job carries (``jobs.carry``), by name.
    """

    id: str
    row_index: int
    completion: str | None
    completion_token_ids: list[int] | None
    num_prompt_tokens: int
    num_completion_tokens: int | None
    finish_reason: str | None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_greedy: list[bool] | None = None
    stop_reason: str | None = None
    candidate_logprobs: list[float] | None = None
    candidate_num_tokens: list[int] | None = None
    candidate_is_greedy: list[bool] | None = None
    sample_index: int = 0
    carried: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.finish_reason in FINISH_REASONS or (self.finish_reason is None and self.candidate_logprobs
                                                        is not None), self.finish_reason
        assert (self.error is None) == (self.finish_reason != "error"), (self.finish_reason, self.error)


def error_row(row_id: str, row_index: int, message: str, num_prompt_tokens: int = 0, sample_index: int = 0, *,
              generated: bool = True) -> OutputRow:
    """The output row of a row that cannot run, or of a request the engine failed (every mode builds them here).

    A row that fails before reaching the engine writes one error row, sample 0; ``message`` names the row and the
    cause. ``generated=False`` (score mode) leaves the generation columns null, as in every row of that mode.
    """
    return OutputRow(id=row_id, row_index=row_index, completion=None,
                     completion_token_ids=[] if generated else None, num_prompt_tokens=num_prompt_tokens,
                     num_completion_tokens=0 if generated else None, finish_reason="error", error=message,
                     sample_index=sample_index)


def part_name(number: int) -> str:
    return f"part-{number:06d}.parquet"


def temp_name(number: int) -> str:
    return f".part-{number:06d}.parquet.tmp"


def committed_parts(output_dir: str | Path) -> list[Path]:
    """The committed part files of ``output_dir``, in part-number order (temporary files are not parts)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    parts = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := PART_RE.match(p.name))]
    return [p for _, p in sorted(parts)]


def write_part_atomically(path: Path, table: pa.Table) -> None:
    """Write ``table`` to ``path`` via a hidden temporary file in the same directory, fsynced, then renamed."""
    match = PART_RE.match(path.name)
    assert match, path
    tmp_path = path.with_name(temp_name(int(match.group(1))))
    with open(tmp_path, "wb") as f:
        with pq.ParquetWriter(f, table.schema) as writer:
            writer.write_table(table)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PartWriter:
    """Buffers finished rows and commits them as numbered part files.

    Owns the buffer and the part numbering of one output directory: numbering continues after the highest
    committed part, so a resumed job never overwrites an earlier part.

    Args:
        output_dir: an existing directory.
        commit_every_rows: commit once this many rows are buffered.
        commit_every_seconds: commit (on the next ``add`` or ``maybe_commit``) once the oldest buffered row has
            waited this long.
        carried_fields: input columns carried into every row (``OutputRow.carried``), after the output columns.
    """

    def __init__(self, output_dir: str | Path, commit_every_rows: int = 1000, commit_every_seconds: float = 30.0,
                 carried_fields: Sequence[pa.Field] = ()):
        self.output_dir = Path(output_dir)
        self.schema = pa.schema([*OUTPUT_SCHEMA, *carried_fields])
        self.commit_every_rows = commit_every_rows
        self.commit_every_seconds = commit_every_seconds
        parts = committed_parts(self.output_dir)
        self.next_part = int(PART_RE.match(parts[-1].name).group(1)) + 1 if parts else 0
        self.buffer: list[OutputRow] = []
        self.oldest_buffered: float | None = None
        self.num_committed_rows = 0

    def add(self, row: OutputRow) -> None:
        """Buffer one finished row; commits a part when a threshold is reached."""
        if not self.buffer:
            self.oldest_buffered = time.monotonic()
        self.buffer.append(row)
        self.maybe_commit()

    def add_group(self, rows: list[OutputRow]) -> None:
        """Buffer rows that must land in the same part (the samples of one input row), then maybe commit.

        NOTE: resume counts a row done when its ``row_index`` is in a committed part, so a row's samples are never
        split across parts; a part may hold up to n - 1 rows beyond ``commit_every_rows``.
        """
        if not self.buffer:
            self.oldest_buffered = time.monotonic()
        self.buffer.extend(rows)
        self.maybe_commit()

    def maybe_commit(self) -> bool:
        """Commit the buffer when it is full or old enough; returns whether a part was written."""
        if not self.buffer:
            return False
        too_old = time.monotonic() - self.oldest_buffered >= self.commit_every_seconds
        if len(self.buffer) >= self.commit_every_rows or too_old:
            self.commit()
            return True
        return False

    def commit(self) -> Path | None:
        """Write every buffered row to the next part file now; returns its path (None when nothing is buffered)."""
        if not self.buffer:
            return None
        columns = {name: [getattr(row, name) for row in self.buffer] for name in OUTPUT_SCHEMA.names}
        for name in self.schema.names[len(OUTPUT_SCHEMA):]:
            columns[name] = [row.carried.get(name) for row in self.buffer]
        table = pa.Table.from_pydict(columns, schema=self.schema)
        path = self.output_dir / part_name(self.next_part)
        write_part_atomically(path, table)
        self.next_part += 1
        self.num_committed_rows += len(self.buffer)
        self.buffer = []
        self.oldest_buffered = None
        return path


def read_output(output_dir: str | Path, columns: list[str] | None = None) -> pa.Table:
    """All committed rows of an output directory as one table, in part order (not sorted by row_index).

    NOTE: ``pq.read_table(output_dir)`` would also try to read job.json and stats.json; this reads the parts only.
    """
    parts = committed_parts(output_dir)
    if not parts:
        return OUTPUT_SCHEMA.empty_table().select(columns or OUTPUT_SCHEMA.names)
    return pq.read_table([str(p) for p in parts], columns=columns, schema=OUTPUT_SCHEMA)
