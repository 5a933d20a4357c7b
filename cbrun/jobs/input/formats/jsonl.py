"""JSON Lines input (``.jsonl``, ``.jsonl.gz``, and ``.json`` / ``.json.gz`` holding JSON Lines; any letter case):
one JSON object per line, read as Arrow record batches.

A ``.json`` file is JSON Lines when its first non-blank line is one whole JSON object (data sets exported by
``datasets`` and the Hugging Face Hub use ``.json`` for JSON Lines); a ``.json`` file holding one JSON array or one
object printed over many lines is refused (``check_json_lines``). An object is copied to a local file first.

A ``JsonlSource`` is an ``InputSource`` (``path``, ``schema``, ``num_rows``, ``iter_batches``), so
``cbrun.jobs.input.reader.PromptReader`` streams it with the same ``row_index``, resume and per-row error rules. Every non-blank
line is one row; blank lines are not rows (as in vLLM's ``run_batch``). Each error of a row names its line as an
editor numbers it, blank lines counted (``JsonlSource.row_place``: ``row 3 (id 'a', line 5 of prompts.jsonl)``).

A file is read with pyarrow's streaming JSON reader (``pyarrow.json.open_json``) when every line of it reads that
way: that is fast, and the types are pyarrow's (inferred from the first block; a column of dates is read as text).
But pyarrow's reader fails a whole block on one bad line or on a value of another type than the block's first, and
here those must be the row's error, not the job's, so such a file is read a line at a time with ``json.loads``:

- a line that is not valid JSON, or not a JSON object, is that row's error;
- a field's Arrow type is inferred over the whole file when the source is opened: nulls are ignored, integers and
  floats make ``float64``, lists and objects are unified with ``pa.unify_schemas(promote_options="permissive")``;
  when lines disagree (text in one, a number in another), the kind most lines hold wins and a line holding
  another kind gets a row error naming the field, but only when the job reads that field.

The scan at open time keeps only counts and types, never rows, so memory does not grow with the file.
"""

from __future__ import annotations

import bisect
import gzip
import json
from array import array
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json

from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.formats import ROW_ERROR_COLUMN, InputFormat, OpenOptions, supported_inputs

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
#: Suffixes of files read as JSON Lines when their first line is a JSON object (``holds_json_lines``).
JSON_SUFFIXES = (".json", ".json.gz")
#: Bytes per block of pyarrow's JSON reader (its schema is inferred from the first block).
ARROW_BLOCK_SIZE = 16 << 20


def holds_json_lines(path: str | Path) -> bool:
    """Whether a ``.json`` file holds JSON Lines: its first non-blank line is one whole JSON object (or it has no
    non-blank line). A JSON array, or one object printed over many lines (``dataset_info.json``), is not.

    Raises:
        OSError: when the file cannot be read (gzip.BadGzipFile included).
    """
    for _, line in numbered_rows(Path(path)):
        try:
            return isinstance(json.loads(line), dict)
        except ValueError:
            return False
    return True


def _blank_lines(path: Path) -> array:
    """For each blank line of the file before its last row, in order, how many rows (non-blank lines) come before
    it (``numbered_rows``' gaps; blank lines after the last row precede no row and are left out).

    Raises:
        InputError: when the file cannot be read.
    """
    counts = array("q")
    try:
        for rows, (number, _) in enumerate(numbered_rows(path)):
            counts.extend([rows] * (number - 1 - rows - len(counts)))  # the blank lines just before this row
    except (OSError, EOFError) as exc:
        raise InputError(f"input file {str(path)!r} is not a readable JSON Lines file: {exc}") from None
    return counts


def _is_gzip(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def _open_binary(path: Path):
    return gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")


def numbered_rows(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes) of every non-blank line, in order."""
    with _open_binary(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line


def _parse(line: bytes) -> tuple[dict | None, str | None]:
    """(the line's object, None), or (None, why it is not a JSON object); the reader names the line
    (``JsonlSource.row_place``)."""
    try:
        value = json.loads(line.rstrip(b"\r\n"))
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        return None, f"the line is not UTF-8 text (byte 0x{byte:02x} at offset {exc.start})"
    except ValueError as exc:
        reason = f"{exc.msg} (column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else str(exc)
        return None, f"the line is not valid JSON: {reason}"
    if not isinstance(value, dict):
        return None, f"the line is not a JSON object (it is {_article(_kind(value))})"
    return value, None


def _shape(value: Any) -> Any:
    """A hashable summary of a value's structure: the kinds of its scalars and the keys of its objects."""
    if isinstance(value, dict):
        return tuple((key, _shape(item)) for key, item in value.items())
    if isinstance(value, list):
        return ("[]", frozenset(_shape(item) for item in value))
    return type(value)


def _kind(value: Any) -> str:
    """The JSON kind of a parsed value: null, boolean, integer, number, string, array or object."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class _FieldTypes:
    """Per field: how many lines hold each kind, and the unified Arrow type of its arrays and objects."""

    def __init__(self, json_text_fields: tuple[str, ...] = ()) -> None:
        self.json_text_fields = json_text_fields
        self.kinds: dict[str, Counter] = {}
        self.nested: dict[str, pa.DataType] = {}
        self.seen_shapes: dict[str, set] = {}

    def add(self, record: dict) -> None:
        for name, value in record.items():
            counts = self.kinds.setdefault(name, Counter())
            kind = _kind(value)
            counts[kind] += 1
            if kind in ("array", "object") and name not in self.json_text_fields:
                self._add_nested(name, value)

    def _add_nested(self, name: str, value: Any) -> None:
        # NOTE: asking Arrow for a value's type costs ~100 us; the value's shape (kinds and keys, no values) is
        # cheap, and lines of one file mostly share a few shapes, so Arrow types each shape once.
        shape = _shape(value)
        seen = self.seen_shapes.setdefault(name, set())
        if shape in seen:
            return
        seen.add(shape)
        try:
            kind = pa.array([value]).type
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            return  # NOTE: a value Arrow cannot type (e.g. [1, "a"]) fails at conversion, as that row's error
        current = self.nested.get(name)
        if current is None:
            self.nested[name] = kind
            return
        try:
            unified = pa.unify_schemas(
                [pa.schema([(name, current)]), pa.schema([(name, kind)])], promote_options="permissive"
            )
            self.nested[name] = unified.field(name).type
        except (pa.ArrowException, TypeError):
            pass  # the first type stays; rows of the other fail at conversion

    def arrow_type(self, name: str, as_json_text: bool) -> pa.DataType:
        """The field's Arrow type: the kind most lines hold (integers and numbers count together)."""
        if as_json_text:
            return pa.string()
        counts: Counter[str] = Counter()
        for kind, count in self.kinds[name].items():
            if kind != "null":
                counts["number" if kind == "integer" else kind] += count
        if not counts:
            return pa.null()
        kind = counts.most_common(1)[0][0]
        if kind == "number":
            return pa.float64() if self.kinds[name]["number"] else pa.int64()
        if kind in ("array", "object"):
            return self.nested.get(name, pa.string())
        return {"boolean": pa.bool_(), "string": pa.string()}[kind]


class JsonlSource:
    """One JSON Lines file (optionally gzip-compressed), scanned once for its row count and schema.

    Args:
        path: the JSON Lines file (``.jsonl``, ``.jsonl.gz``, or ``.json`` / ``.json.gz`` holding JSON Lines).
        json_text_fields: fields read as their JSON text (a string column) instead of a typed column, e.g. an
            OpenAI batch request's ``body``, whose fields differ from line to line.

    Attributes:
        schema: one field per JSON key seen in any line, in first-seen order.
        num_rows: non-blank lines.

    Raises:
        InputError: when the file cannot be read (missing, not gzip, ...).
    """

    def __init__(self, path: Path, json_text_fields: tuple[str, ...] = ()):
        self.path = Path(path)
        self.json_text_fields = tuple(json_text_fields)
        self._blank_lines: array | None = None  # ``row_place``'s, read at its first call
        # NOTE: JSON text fields need the lines' own text, which pyarrow's reader does not keep
        self.arrow_readable = not self.json_text_fields and self._arrow_scan()
        if not self.arrow_readable:
            self._line_scan()

    def _arrow_stream(self):
        return pa.input_stream(str(self.path), compression="gzip" if _is_gzip(self.path) else None)

    def _arrow_scan(self) -> bool:
        """Count rows and take the schema with pyarrow's reader; False when some block does not read, or holds text
        that is not UTF-8 (pyarrow's reader keeps such bytes; the line scan names their line)."""
        try:
            reader = pa_json.open_json(
                self._arrow_stream(), read_options=pa_json.ReadOptions(block_size=ARROW_BLOCK_SIZE)
            )
            self.num_rows = 0
            for batch in reader:
                batch.validate(full=True)  # raises ArrowInvalid on a string that is not UTF-8
                self.num_rows += batch.num_rows
        except (pa.ArrowException, OSError, EOFError, ValueError):
            return False
        # NOTE: pyarrow reads a column of date-like strings as timestamps; a prompt or id is text, so read as text
        self.schema = pa.schema(
            [pa.field(f.name, pa.string()) if pa.types.is_timestamp(f.type) else f for f in reader.schema]
        )
        return True

    def _line_scan(self) -> None:
        """Count rows and infer the schema a line at a time (see the module docstring)."""
        types = _FieldTypes(self.json_text_fields)
        self.num_rows = 0
        try:
            for _, line in numbered_rows(self.path):
                self.num_rows += 1
                record, _ = _parse(line)
                if record is not None:
                    types.add(record)
        except (OSError, EOFError) as exc:
            raise InputError(f"input file {str(self.path)!r} is not a readable JSON Lines file: {exc}") from None
        self.schema = pa.schema([(name, types.arrow_type(name, name in self.json_text_fields)) for name in types.kinds])

    def row_place(self, row: int) -> str:
        """``line N of NAME``: the line (1-based, as an editor numbers them) that holds the file's row ``row``
        (0-based; blank lines are not rows). The first call reads the file once more for its blank lines, which
        only a row's error needs."""
        if self._blank_lines is None:
            self._blank_lines = _blank_lines(self.path)
        # NOTE: the blank lines before row r are those met when at most r rows had been read
        return f"line {row + 1 + bisect.bisect_right(self._blank_lines, row)} of {self.path.name}"

    def iter_batches(
        self, columns: list[str], batch_size: int, first_row: int, skip: np.ndarray | None
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        """Yield (row index of the batch's first row, batch) over contiguous runs of ``batch_size`` rows.

        Each batch holds ``columns`` and ``ROW_ERROR_COLUMN``. Batches whose rows are all in ``skip`` are not
        yielded, and skipped rows inside a yielded batch are not parsed (their values are null).

        Args:
            first_row: the global row index of this file's first row.
            skip: bool array over this file's rows, True where the row needs no reading; None reads all.
        """
        if self.arrow_readable:
            yield from self._arrow_batches(columns, batch_size, first_row, skip)
            return
        pending: list[tuple[int, bytes] | None] = []
        start = 0
        for local, numbered in enumerate(numbered_rows(self.path)):
            pending.append(None if skip is not None and skip[local] else numbered)
            if len(pending) == batch_size:
                if any(item is not None for item in pending):
                    yield first_row + start, self._batch(pending, columns)
                start += len(pending)
                pending = []
        if any(item is not None for item in pending):
            yield first_row + start, self._batch(pending, columns)

    def _arrow_batches(
        self, columns: list[str], batch_size: int, first_row: int, skip: np.ndarray | None
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        reader = pa_json.open_json(
            self._arrow_stream(),
            read_options=pa_json.ReadOptions(block_size=ARROW_BLOCK_SIZE),
            parse_options=pa_json.ParseOptions(explicit_schema=self.schema),
        )
        local = 0
        for block in reader:
            for start in range(0, block.num_rows, batch_size):
                batch = block.slice(start, batch_size)
                if skip is None or not skip[local : local + batch.num_rows].all():
                    arrays = [batch.column(name) for name in columns]
                    arrays.append(pa.nulls(batch.num_rows, pa.string()))
                    yield first_row + local, pa.RecordBatch.from_arrays(arrays, names=[*columns, ROW_ERROR_COLUMN])
                local += batch.num_rows

    def _batch(self, lines: list[tuple[int, bytes] | None], columns: list[str]) -> pa.RecordBatch:
        records: list[dict | None] = []
        errors: list[str | None] = []
        for item in lines:
            record, error = (None, None) if item is None else _parse(item[1])
            records.append(record)
            errors.append(error)
        arrays = [self._column(name, records, errors) for name in columns]
        arrays.append(pa.array(errors, type=pa.string()))
        return pa.RecordBatch.from_arrays(arrays, names=[*columns, ROW_ERROR_COLUMN])

    def _column(self, name: str, records: list[dict | None], errors: list[str | None]) -> pa.Array:
        """The field's values as an array of its schema type; a value that does not fit is null + a row error."""
        kind = self.schema.field(name).type
        as_text = name in self.json_text_fields
        values = [None if r is None else r.get(name) for r in records]
        if as_text:
            values = [None if v is None else json.dumps(v, ensure_ascii=False) for v in values]
        try:
            return pa.array(values, type=kind)
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            pass
        fitted = []
        for i, value in enumerate(values):
            try:
                pa.array([value], type=kind)
                fitted.append(value)
            except (pa.ArrowException, ValueError, TypeError, OverflowError):
                fitted.append(None)
                if errors[i] is None:
                    errors[i] = (
                        f"field {name!r} holds {_article(_kind(value))} ({_short(value)}), but the column's type "
                        f"(from the other lines) is {kind}"
                    )
        return pa.array(fitted, type=kind)


def _article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_json_lines(path: Path) -> None:
    """Refuse a ``.json`` / ``.json.gz`` file that holds a JSON document rather than JSON Lines.

    Raises:
        InputError: for a JSON array, or an object printed over many lines, or a file that cannot be read.
    """
    if not path.name.lower().endswith(JSON_SUFFIXES):
        return
    try:
        if holds_json_lines(path):
            return
    except OSError as exc:
        raise InputError(f"input file {str(path)!r} cannot be read: {exc}") from None
    raise InputError(
        f"input file {str(path)!r} is JSON but not JSON Lines (its first line is not one whole JSON "
        f"object: a JSON array, or a document printed over many lines); cbrun reads "
        f"{supported_inputs()}. Convert an array, e.g. jq -c '.[]' {path.name} > {path.stem}.jsonl"
    )


def first_object_fields(path: Path) -> list[str]:
    """The keys of the file's first line holding a JSON object, in order ([] when none does): read cheaply."""
    for _, line in numbered_rows(path):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return list(value)
    return []


def _open(path: Path, options: OpenOptions) -> JsonlSource:
    return JsonlSource(path, options.json_text_fields)


FORMAT = InputFormat(
    name="jsonl",
    title="JSON Lines",
    suffixes=JSONL_SUFFIXES + JSON_SUFFIXES,
    # NOTE: no open_object: JSON Lines is read by line offsets from a local file, so an object is copied first
    open_file=_open,
    check_file=check_json_lines,
    field_names=first_object_fields,
    listing=".jsonl, .jsonl.gz, .json or .json.gz holding JSON Lines",
    order=10,
)
