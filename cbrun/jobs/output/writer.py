"""Commit finished rows to ``part-NNNNNN.parquet`` files, atomically.

Each part is written under a hidden temporary name, flushed, fsynced, then ``os.replace``d to its final name (and
the directory fsynced), so whoever lists the directory sees whole parts or nothing. A kill loses only the rows
buffered since the last commit; resume recomputes them. A commit interrupted at any line (a signal raises there)
can simply be run again: it writes the same rows to the same part name, so no row is ever committed twice::

    finished rows --> buffer --(commit_every_rows or commit_every_seconds)--> .part-000007.parquet.tmp
                                                                                   | flush, fsync, os.replace
                                                                                   v
                                                                             part-000007.parquet
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.jobs.output.lock import Shard
from cbrun.jobs.store.files import write_file

LOGPROB_TYPE = pa.struct([pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32())])
#: A committed part: ``part-NNNNNN.parquet`` (a plain run), ``part-sIIIIofNNNN-NNNNNN.parquet`` (shard I of N of a
#: sharded run, ``cbrun.jobs.run.sharding``), so that the shards of one output never pick the same name.
PART_RE = re.compile(r"^part-(?:s(?P<index>\d{4,})of(?P<count>\d{4,})-)?(?P<number>\d{6,})\.parquet$")
TEMP_RE = re.compile(r"^\.part-(?:s(?P<index>\d{4,})of(?P<count>\d{4,})-)?(?P<number>\d{6,})\.parquet(?:\.\d+)?\.tmp$")

#: The one schema of every part file.
OUTPUT_SCHEMA = pa.schema(
    [
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
        # logprobs[i] lists token i's top candidates (and the chosen token) as {token_id, logprob} structs: lists of
        # structs, not maps, so that every common reader (datasets, pandas, duckdb, polars) holds the column.
        pa.field("logprobs", pa.list_(pa.list_(LOGPROB_TYPE))),
        pa.field("prompt_logprobs", pa.list_(pa.float32())),
        pa.field("prompt_greedy", pa.list_(pa.bool_())),
        # What ended a "stop" row: the stop string, or the stop (or EOS) token id as text; null otherwise.
        pa.field("stop_reason", pa.string()),
        # Score mode (input.mode = "score") only, one entry per candidate; null in generate mode (see jobs.modes.scoring):
        pa.field("candidate_logprobs", pa.list_(pa.float64())),
        pa.field("candidate_num_tokens", pa.list_(pa.int32())),
        pa.field("candidate_is_greedy", pa.list_(pa.bool_())),
        # Which of the row's samples this is (sampling.n or the row's n column): 0 .. n-1; 0 for one sample per row.
        pa.field("sample_index", pa.int32(), nullable=False),
        # Generate mode's per-request timings in seconds (``cbrun.engine.outputs.RequestOutput``) when output.row_timings is
        # on; null otherwise, on error rows and in score mode. They differ from run to run (``TIMING_COLUMNS``).
        pa.field("queue_s", pa.float64()),  # arrival in the engine -> first admission into the batch
        pa.field("ttft_s", pa.float64()),  # arrival in the engine -> first generated token
        pa.field("decode_s", pa.float64()),  # first generated token -> finished
        # Whether the completion satisfies the row's structured_outputs constraint (JSON parsed and checked with
        # jsonschema); null for a row without one, and for error rows.
        pa.field("structured_output_valid", pa.bool_()),
    ]
)

#: The output columns that are timings (``OUTPUT_SCHEMA``), not results.
TIMING_COLUMNS = ("queue_s", "ttft_s", "decode_s")

FINISH_REASONS = ("stop", "length", "error")


@dataclass
class OutputRow:
    """One finished row as stored: a completion, or an error (``finish_reason == "error"``, ``completion`` null).
    A score-mode row has its candidates' columns instead, and null generation columns.

    ``logprobs`` (per generated token, {token id: log-probability}), ``prompt_logprobs`` and ``prompt_greedy`` are
    None unless the job's sampling settings ask for them. ``stop_reason`` says which stop string or token id ended
    a "stop" row. The ``candidate_*`` lists are score mode's (one entry per candidate), None in generate mode.
    A row with ``n`` samples is stored as ``n`` output rows of the same ``id`` and ``row_index``, ``sample_index``
    0 .. n-1. ``queue_s`` / ``ttft_s`` / ``decode_s`` are the request's timings (``TIMING_COLUMNS``), None where
    none apply. ``carried`` holds the values of the input columns the job carries (``cbrun.jobs.input.carry``), by name.
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
    queue_s: float | None = None
    ttft_s: float | None = None
    decode_s: float | None = None
    structured_output_valid: bool | None = None
    carried: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.finish_reason in FINISH_REASONS or (
            self.finish_reason is None and self.candidate_logprobs is not None
        ), self.finish_reason
        assert (self.error is None) == (self.finish_reason != "error"), (self.finish_reason, self.error)


def error_row(
    row_id: str,
    row_index: int,
    message: str,
    num_prompt_tokens: int = 0,
    sample_index: int = 0,
    *,
    generated: bool = True,
) -> OutputRow:
    """The output row of a row that cannot run, or of a request the engine failed (every mode builds them here).

    A row that fails before reaching the engine writes one error row, sample 0; ``message`` names the row and the
    cause. ``generated=False`` (score mode) leaves the generation columns null, as in every row of that mode.
    """
    return OutputRow(
        id=row_id,
        row_index=row_index,
        completion=None,
        completion_token_ids=[] if generated else None,
        num_prompt_tokens=num_prompt_tokens,
        num_completion_tokens=0 if generated else None,
        finish_reason="error",
        error=message,
        sample_index=sample_index,
    )


def part_name(number: int, shard: Shard = Shard()) -> str:
    """The part file name of part ``number`` of ``shard`` (a plain run, shard 0/1, keeps the unprefixed name)."""
    if shard.count == 1:
        return f"part-{number:06d}.parquet"
    return f"part-s{shard.index:04d}of{shard.count:04d}-{number:06d}.parquet"


def part_shard(match: re.Match) -> Shard:
    """The shard a ``PART_RE`` (or ``TEMP_RE``) match names; unprefixed names are shard 0/1."""
    if match.group("count") is None:
        return Shard()
    return Shard(int(match.group("index")), int(match.group("count")))


def committed_parts(output_dir: str | Path, shard: Shard | None = None) -> list[Path]:
    """The committed part files of ``output_dir`` (temporary files are not parts), in order: by shard (plain parts
    first), then part number.

    Args:
        shard: only this shard's parts; None: every part.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    parts = []
    for path in output_dir.iterdir():
        if (match := PART_RE.match(path.name)) and (shard is None or part_shard(match) == shard):
            owner = part_shard(match)
            parts.append(((owner.count, owner.index, int(match.group("number"))), path))
    return [p for _, p in sorted(parts)]


def write_part_atomically(path: Path, table: pa.Table) -> None:
    """Write ``table`` to ``path`` whole or not at all (``cbrun.jobs.store.files.write_file``: temporary file, fsync, rename,
    fsync of the directory)."""
    assert PART_RE.match(path.name), path

    def write(f) -> None:
        with pq.ParquetWriter(f, table.schema) as writer:
            writer.write_table(table)

    write_file(path, write)


@dataclass
class _Batch:
    """The rows waiting for part ``number``; replaced whole, in one assignment, once that part is committed."""

    number: int
    rows: list[OutputRow] = field(default_factory=list)
    oldest: float | None = None  # time.monotonic() when the first row came
    num_committed_rows: int = 0  # output rows committed before this batch, by this writer


class PartWriter:
    """Buffers finished rows and commits them as numbered part files.

    Owns the buffer and the part numbering of one output directory: numbering continues after the highest
    committed part, so a resumed job never overwrites an earlier part. ``cbrun.jobs.output.output_dir.OutputDir.start`` makes
    it; it is the directory's only appender.

    Args:
        output_dir: an existing directory.
        commit_every_rows: commit once this many rows are buffered.
        commit_every_seconds: commit (on the next ``add`` or ``maybe_commit``) once the oldest buffered row has
            waited this long.
        carried_fields: input columns carried into every row (``OutputRow.carried``), after the output columns.
        shard: the share of the output this writer appends to; its parts carry the shard in their names
            (``part_name``) and are numbered on their own.
    """

    def __init__(
        self,
        output_dir: str | Path,
        commit_every_rows: int = 1000,
        commit_every_seconds: float = 30.0,
        carried_fields: Sequence[pa.Field] = (),
        shard: Shard = Shard(),
    ):
        self.output_dir = Path(output_dir)
        self.schema = pa.schema([*OUTPUT_SCHEMA, *carried_fields])
        self.commit_every_rows = commit_every_rows
        self.commit_every_seconds = commit_every_seconds
        self.shard = shard
        self._batch = _Batch(self._first_part_number())

    def _first_part_number(self) -> int:
        """The next part number after the highest committed part of this writer's shard."""
        parts = committed_parts(self.output_dir, self.shard)
        return int(PART_RE.match(parts[-1].name).group("number")) + 1 if parts else 0

    @property
    def buffer(self) -> list[OutputRow]:
        return self._batch.rows

    @property
    def next_part(self) -> int:
        return self._batch.number

    @property
    def num_committed_rows(self) -> int:
        return self._batch.num_committed_rows

    def add(self, row: OutputRow) -> None:
        """Buffer one finished row; commits a part when a threshold is reached."""
        self.add_group([row])

    def add_group(self, rows: list[OutputRow]) -> bool:
        """Buffer rows that must land in the same part (the samples of one input row), then maybe commit; returns
        whether a part was committed.

        NOTE: resume counts a row done when its ``row_index`` is in a committed part, so a row's samples are never
        split across parts; a part may hold up to n - 1 rows beyond ``commit_every_rows``.
        """
        batch = self._batch
        if batch.oldest is None:
            batch.oldest = time.monotonic()
        batch.rows.extend(rows)
        return self.maybe_commit()

    def maybe_commit(self) -> bool:
        """Commit the buffer when it is full or old enough; returns whether a part was written."""
        batch = self._batch
        if not batch.rows:
            return False
        too_old = time.monotonic() - batch.oldest >= self.commit_every_seconds
        if len(batch.rows) >= self.commit_every_rows or too_old:
            self.commit()
            return True
        return False

    def commit(self) -> Path | None:
        """Write every buffered row to the next part file now; returns its path (None when nothing is buffered).

        Safe to call again after it was interrupted at any line: until the batch is replaced (the last line), a
        retry writes the same rows to the same part name again; after, there is nothing left to write.
        """
        batch = self._batch
        if not batch.rows:
            return None
        path = self.output_dir / part_name(batch.number, self.shard)
        write_part_atomically(path, rows_to_table(batch.rows, self.schema))
        self._batch = _Batch(batch.number + 1, num_committed_rows=batch.num_committed_rows + len(batch.rows))
        return path


def rows_to_table(rows: list[OutputRow], schema: pa.Schema = OUTPUT_SCHEMA) -> pa.Table:
    """``OutputRow``s as a table of ``schema``: ``OUTPUT_SCHEMA`` (logprobs dicts become {token_id, logprob} lists),
    then the carried input columns (``OutputRow.carried``), if any."""
    columns = {name: [getattr(row, name) for row in rows] for name in OUTPUT_SCHEMA.names}
    columns["logprobs"] = [
        None if steps is None else [_logprob_entries(step) for step in steps] for steps in columns["logprobs"]
    ]
    for name in schema.names[len(OUTPUT_SCHEMA) :]:
        columns[name] = [row.carried.get(name) for row in rows]
    return pa.Table.from_pydict(columns, schema=schema)


def _logprob_entries(step) -> list[dict]:
    """One token's {token id: logprob} (or, from an older part, a list of (token id, logprob)) as struct dicts."""
    items = step.items() if isinstance(step, dict) else step
    return [{"token_id": token_id, "logprob": logprob} for token_id, logprob in items]


def conform_table(table: pa.Table) -> pa.Table:
    """A part read back, in ``OUTPUT_SCHEMA`` plus its carried columns: parts of older versions hold logprobs as
    maps, or lack columns."""
    carried = [f for f in table.schema if f.name not in OUTPUT_SCHEMA.names]
    schema = pa.schema([*OUTPUT_SCHEMA, *carried])
    if table.schema.equals(schema):
        return table
    columns = []
    for f in schema:
        if f.name not in table.column_names:
            fill = 0 if f.name == "sample_index" else None
            columns.append(pa.array([fill] * table.num_rows, f.type))
        elif f.name == "logprobs" and not table.schema.field(f.name).type.equals(f.type):
            steps = table.column(f.name).to_pylist()
            columns.append(pa.array([None if s is None else [_logprob_entries(t) for t in s] for s in steps], f.type))
        else:
            columns.append(table.column(f.name).cast(f.type))
    return pa.Table.from_arrays(columns, schema=schema)


def read_parts(parts: Iterable) -> pa.Table | None:
    """The rows of ``parts`` (local paths, or object files opened one at a time and closed here), in order, each
    conformed to the output schema (``conform_table``); None when there is none."""
    tables = []
    for part in parts:
        if isinstance(part, str | Path):
            tables.append(conform_table(pq.read_table(part)))
            continue
        with part:
            tables.append(conform_table(pq.read_table(part)))
    return pa.concat_tables(tables, promote_options="default") if tables else None
