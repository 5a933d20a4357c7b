"""Stream prompt rows out of Parquet or JSON Lines files (or a saved ``datasets`` data set) in record batches.

The input is never loaded whole: Parquet is read with ``ParquetFile.iter_batches(batch_size, columns=...)`` over
only the columns the job needs, and row groups whose rows are all done already (resume) are not read at all. Each
row keeps its ``row_index``, its position in the whole input (files in sorted order), which is stable across runs
and is the key the output and the resume bitmap use.

The files of one input are read as one table whose schema is the union of theirs (``unify_schemas``): a column
missing from a file is null in its rows, a column whose types differ is read in the type both widen to (int32 and
int64 as int64, a column of Arrow type ``null`` as the other files' type), and a dictionary-encoded column (pandas
categoricals) as its values' type. Every source kind goes through the same step (``conform_batch``), so a new input
format only has to give its files' schemas and record batches.

Setup problems (a missing file, a column in no file, a column of the wrong type, columns whose types cannot be
unified) raise before any row is read; problems of one row (a null or empty prompt, a null template field, bytes
that are not UTF-8, a bad per-row sampling value) become that row's ``error`` and the job goes on.

Per-row settings: a column named like a sampling setting (or its vLLM name, e.g. ``max_tokens``), or ``n``, sets
it for its row; the reader names these columns once at start, and ``per_row_settings=False`` reads none.
"""

from __future__ import annotations

import json
import logging
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.sampling_params import (
    SAMPLING_FIELD_TYPES,
    SAMPLING_FIELDS,
    canonical_name,
    coerce_num_samples,
    coerce_sampling_value,
)
from jobs.input.arrow_types import is_binary_type, is_list_type, is_text_type
from jobs.input.errors import InputError
from jobs.input.jsonl_source import JSON_SUFFIXES, JSONL_SUFFIXES, ROW_ERROR_COLUMN, JsonlSource, holds_json_lines
from jobs.storage import StorageError, basename, is_uri, list_files, local_path, open_input
from jobs.storage_cache import local_copy

logger = logging.getLogger("cbrun.reader")

#: The optional input column that gives a row its own number of samples (overrides the job's ``sampling.n``).
NUM_SAMPLES_COLUMN = "n"
#: The column of ``PromptReader.read_span`` batches that holds each row's index in the whole input.
ROW_INDEX_COLUMN = "__cbrun_row_index__"


@dataclass
class InputRow:
    """One input row, ready to become a request (or an error row).

    Attributes:
        row_index: position of the row in the whole input, counting from 0.
        id: the row's id as a string (the id column's value, else the row index).
        prompt: the prompt text (from the prompt column or the filled-in template); None with a token-id prompt.
        prompt_token_ids: the prompt as token ids, when read from ``prompt_ids_column``.
        sampling_overrides: per-row sampling settings from columns named like SamplingParams fields (nulls left out).
        extra: {role: value} of the reader's ``extra_columns`` (e.g. candidates, messages), as read; the job
            checks them.
        num_samples: the row's ``n`` column (samples to generate, >= 1); None: the job's ``sampling.n``.
        error: why the row cannot run, naming the row and the cause; None for a good row.
    """

    row_index: int
    id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    num_samples: int | None = None
    error: str | None = None


class _Undecodable:
    """Stands in for a value pyarrow could not turn into a Python object."""

    def __init__(self, reason: str):
        self.reason = reason


#: Parquet files start (and end) with these 4 bytes.
PARQUET_MAGIC = b"PAR1"
#: What ``input_file_format`` reads, for error messages.
SUPPORTED_INPUTS = (
    ".parquet, .jsonl, .jsonl.gz, .json or .json.gz holding JSON Lines (any letter case), a Parquet "
    "file of any name (e.g. Hive's 000000_0), or a datasets save_to_disk directory"
)
#: Files of a directory that are documentation, not data: ignored (a Hugging Face data set's README.md).
DOC_SUFFIXES = (".md", ".rst")


def input_file_format(path: Path) -> str | None:
    """How one input file is read: "parquet", "jsonl", or None (not a format cbrun reads).

    By name, letter case ignored: ``.parquet``; ``.jsonl`` / ``.jsonl.gz``; ``.json`` / ``.json.gz`` whose first
    line is one whole JSON object (JSON Lines, ``jobs.input.jsonl_source.holds_json_lines``). Any other name is Parquet
    when the file starts with Parquet's magic bytes (Hive and some Spark writers leave Parquet files without a
    suffix).

    Raises:
        InputError: for a ``.json`` file that holds a JSON document (one array, or an object printed over many
            lines) rather than JSON Lines, or one that cannot be read.
    """
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(JSON_SUFFIXES):
        try:
            if holds_json_lines(path):
                return "jsonl"
        except OSError as exc:
            raise InputError(f"input file {str(path)!r} cannot be read: {exc}") from None
        raise InputError(
            f"input file {str(path)!r} is JSON but not JSON Lines (its first line is not one whole JSON "
            f"object: a JSON array, or a document printed over many lines); cbrun reads "
            f"{SUPPORTED_INPUTS}. Convert an array, e.g. jq -c '.[]' {path.name} > {path.stem}.jsonl"
        )
    try:
        with open(path, "rb") as f:
            return "parquet" if f.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC else None
    except OSError:
        return None


def _is_hidden(relative: Path) -> bool:
    """Spark/Hive's rule: a path part starting with "." or "_" (``_SUCCESS``, ``.part-0.crc``) is not data."""
    return any(part.startswith((".", "_")) for part in relative.parts)


def _is_doc(path: Path) -> bool:
    return path.suffix.lower() in DOC_SUFFIXES


def list_input_files(path: str | Path) -> tuple[str, list[Path]]:
    """Find the files of an input: one Parquet or JSON Lines file, a directory of them (mixed or not, searched
    recursively), or a ``save_to_disk`` data set. What a file is read as: ``input_file_format``.

    In a directory, files and folders whose name starts with "." or "_" are ignored, as Spark and Hive do
    (``_SUCCESS``, ``.crc`` files, ``_cbrun/``), and so are ``.md`` / ``.rst`` documents (a data set's README.md);
    any other file that is not a format cbrun reads is refused, so that no rows are left out unseen.

    Returns:
        ("parquet" (Parquet and JSON Lines files, see ``open_source``) or "arrow", files in reading order).

    Raises:
        InputError: when the path does not exist, holds nothing readable, is a file of a format cbrun does not
            read, or is a directory that holds such files (named, with the formats cbrun reads).
    """
    if is_uri(path):
        return "parquet", list_object_files(str(path))
    path = Path(local_path(path))
    if not path.exists():
        raise InputError(f"input {str(path)!r} not found: give a Parquet or JSON Lines file, or a directory of them")
    if path.is_file():
        if input_file_format(path) is None:
            raise InputError(f"input file {str(path)!r} is not a format cbrun reads; cbrun reads {SUPPORTED_INPUTS}")
        return "parquet", [path]
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise InputError(
            f"input {str(path)!r} is a DatasetDict; point the input at one split, e.g. "
            f"{str(path / (splits[0] if splits else 'train'))!r}"
        )
    if (path / "state.json").is_file():
        data_files = json.loads((path / "state.json").read_text()).get("_data_files", [])
        files = [path / f["filename"] for f in data_files]
        if files:
            return "arrow", files
    candidates = sorted(
        p for p in path.rglob("*") if p.is_file() and not _is_hidden(p.relative_to(path)) and not _is_doc(p)
    )
    unreadable = [p for p in candidates if input_file_format(p) is None]
    if unreadable:
        names = ", ".join(repr(p.relative_to(path).as_posix()) for p in unreadable[:10])
        more = f" and {len(unreadable) - 10} more" if len(unreadable) > 10 else ""
        raise InputError(
            f"input directory {str(path)!r} holds files cbrun cannot read: {names}{more}; cbrun reads "
            f"{SUPPORTED_INPUTS} (names starting with '.' or '_' are ignored). Move them out, or point "
            f"--input at the files to read"
        )
    if not candidates:
        raise InputError(
            f"input directory {str(path)!r} holds no .parquet files, no .jsonl files and no saved data set"
        )
    return "parquet", candidates


def object_file_format(uri: str) -> str | None:
    """How one input object is read, by its name alone (``input_file_format``'s rules without opening it)."""
    name = basename(uri).lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES + JSON_SUFFIXES):
        return "jsonl"
    return None


def list_object_files(uri: str) -> list[str]:
    """The input objects under an object-store URI (one object, or every object below a prefix, in name order),
    with ``list_input_files``'s rules: names starting with "." or "_" and documents skipped, others refused.

    Raises:
        InputError: when nothing is there, or an object is not ``.parquet`` / ``.jsonl`` / ``.json``(``.gz``).
    """
    try:
        objects = list_files(uri)
    except (ImportError, StorageError) as exc:
        raise InputError(f"input {uri!r} cannot be listed: {exc}") from None
    root = uri.rstrip("/")
    relative = {o: o[len(root) + 1 :] if o != root else basename(o) for o in objects}
    candidates = [o for o in objects if not _is_hidden(Path(relative[o])) and not _is_doc(Path(relative[o]))]
    if not candidates:
        raise InputError(
            f"input {uri!r} not found: no objects there (give a Parquet or JSON Lines object, or a prefix of them)"
        )
    unreadable = [relative[o] for o in candidates if object_file_format(o) is None]
    if unreadable:
        raise InputError(
            f"input {uri!r} holds objects cbrun cannot read: {', '.join(map(repr, unreadable[:10]))}; "
            f"in an object store cbrun reads .parquet, .jsonl and .json(.gz) objects"
        )
    return candidates


class _ParquetSource:
    """One Parquet file: its schema, row count and row-group offsets come from the footer alone."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.file = pq.ParquetFile(open_input(path) if is_uri(path) else path)
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


def open_source(kind: str, path: Path, json_text_fields: tuple[str, ...] = ()):
    """The source object of one input file: Arrow stream (``kind == "arrow"``), JSON Lines (by suffix) or Parquet."""
    if kind == "arrow":
        return _ArrowStreamSource(path)
    if is_uri(path):
        if object_file_format(path) == "jsonl":
            # NOTE: JSON Lines is read by line offsets from a local file: the object is copied to a temporary file
            return JsonlSource(local_copy(path), json_text_fields)
        return _ParquetSource(path)
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


def _plain_type(kind: pa.DataType) -> pa.DataType:
    """A dictionary-encoded type read as its values' type (a categorical of strings is text)."""
    return kind.value_type if pa.types.is_dictionary(kind) else kind


def unify_schemas(sources: list, columns: list[str] | None = None) -> pa.Schema:
    """The union of the sources' columns, in first-seen order, each in the type every file's type widens to.

    Args:
        sources: objects with ``schema`` (``pa.Schema``) and ``path``.
        columns: only these columns (those a job reads: a clash in a column it never reads does not matter);
            None: all.

    Raises:
        InputError: when a column's types cannot be unified, naming the column, the files and their types.
    """
    schemas = [
        pa.schema(
            [pa.field(f.name, _plain_type(f.type)) for f in source.schema if columns is None or f.name in columns]
        )
        for source in sources
    ]
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    types: dict[str, dict[pa.DataType, list[str]]] = {}
    for source, schema in zip(sources, schemas):
        for f in schema:
            types.setdefault(f.name, {}).setdefault(f.type, []).append(str(source.path))
    for name, by_type in types.items():
        try:
            pa.unify_schemas([pa.schema([pa.field(name, kind)]) for kind in by_type], promote_options="permissive")
        except (pa.ArrowTypeError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
            listed = "; ".join(
                f"{kind} in {', '.join(repr(p) for p in paths[:3])}{' ...' if len(paths) > 3 else ''}"
                for kind, paths in by_type.items()
            )
            raise InputError(
                f"column {name!r} has types that cannot be read as one across the input's files: {listed}"
            ) from None
    raise InputError("the input files' schemas cannot be unified")


def conform_batch(batch: pa.RecordBatch, schema: pa.Schema, columns: list[str]) -> pa.RecordBatch:
    """``batch`` as ``columns`` of the unified ``schema``: dictionary columns decoded, types widened, a column the
    file lacks filled with nulls."""
    arrays = []
    for name in columns:
        kind = schema.field(name).type
        if name not in batch.schema.names:
            arrays.append(pa.nulls(batch.num_rows, kind))
            continue
        array = batch.column(name)
        if pa.types.is_dictionary(array.type):
            array = array.dictionary_decode()
        arrays.append(array if array.type == kind else array.cast(kind))
    return pa.RecordBatch.from_arrays(arrays, names=columns)


def template_fields(template: str) -> list[str]:
    """The column names a template's ``{field}`` placeholders refer to (``{a.b}`` and ``{a[0]}`` refer to ``a``).

    Raises:
        InputError: for a malformed template or a positional field like ``{}`` or ``{0}``.
    """
    names = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise InputError(f"input.template is not a valid format string: {exc}") from None
    for _, field_name, _, _ in parsed:
        if field_name is None:
            continue
        root = field_name.split(".")[0].split("[")[0]
        if not root or root.isdigit():
            raise InputError(f"input.template fields must be column names like {{question}}, got {{{field_name}}}")
        if root not in names:
            names.append(root)
    return names


class PromptReader:
    """Reads the rows of one input, as configured, in record batches.

    Attributes:
        num_rows: rows the job covers (the input's rows, cut to ``limit``).
        num_input_rows: rows in the whole input.
        column_names: every column of any file, in first-seen order.
        schema: the union of the files' schemas over the columns read (``unify_schemas``); batches are read in it.
        sampling_columns: input columns that override a sampling setting per row.
        setting_of_column: {column: the SamplingParams field it sets} (a vLLM-named column maps to our name).
        samples_column: ``NUM_SAMPLES_COLUMN`` when the input has it (samples per row), else None.
        no_columns_known: no file names a column (every file is an empty JSON Lines file): an input of no rows,
            whose columns are not checked and read as null columns.

    Raises:
        InputError: from the constructor, for a missing input, a column in no file, a column of the wrong type or
            columns whose types cannot be unified across files.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        prompt_column: str | None = None,
        prompt_ids_column: str | None = None,
        id_column: str | None = None,
        template: str | None = None,
        limit: int | None = None,
        batch_size: int = 1024,
        extra_columns: dict[str, str] | None = None,
        per_row_settings: bool = True,
        json_text_fields: tuple[str, ...] = (),
    ):
        self.path = str(path)
        self.prompt_column = prompt_column
        self.prompt_ids_column = prompt_ids_column
        self.id_column = id_column
        self.template = template
        self.batch_size = batch_size
        # {role: column}, e.g. {"candidates_column": "answers"}: read into InputRow.extra, checked by the job.
        self.extra_columns = dict(extra_columns or {})
        kind, files = list_input_files(path)
        # json_text_fields: JSON Lines fields read as JSON text (an OpenAI batch request's body; see jobs.input.jsonl_source)
        self.sources = [open_source(kind, f, json_text_fields) for f in files]
        self.column_names = list(dict.fromkeys(name for source in self.sources for name in source.schema.names))
        self.num_input_rows = sum(s.num_rows for s in self.sources)
        self.num_rows = self.num_input_rows if limit is None else min(limit, self.num_input_rows)
        self.template_columns = template_fields(template) if template is not None else []
        self.setting_of_column = _setting_columns(self.column_names) if per_row_settings else {}
        self.sampling_columns = list(self.setting_of_column)
        self.samples_column = (
            NUM_SAMPLES_COLUMN if per_row_settings and NUM_SAMPLES_COLUMN in self.column_names else None
        )
        self.columns = list(
            dict.fromkeys(
                c
                for c in [
                    id_column,
                    prompt_column,
                    prompt_ids_column,
                    *self.template_columns,
                    *self.sampling_columns,
                    self.samples_column,
                    *self.extra_columns.values(),
                ]
                if c is not None
            )
        )
        self._check_columns()
        self.schema = self._unified_schema()
        self._check_types()
        named = [*self.sampling_columns, *([self.samples_column] if self.samples_column else [])]
        if named:
            logger.info(
                "per-row settings from columns: %s (input.per_row_settings = false reads them as data)",
                ", ".join(named),
            )
        for column in named:
            setting = self.setting_of_column.get(column, NUM_SAMPLES_COLUMN)
            kind = self.schema.field(column).type
            if not _type_fits(SAMPLING_FIELD_TYPES.get(setting, "int"), kind):
                logger.warning(
                    "column %r sets %s per row but holds %s: each of its non-null values will be a row "
                    "error; if it is data, set input.per_row_settings = false",
                    column,
                    setting,
                    kind,
                )

    def add_extra_columns(self, extra_columns: dict[str, str]) -> None:
        """Also read ``extra_columns`` ({role: column}) into ``InputRow.extra``, e.g. ``output.keep_columns``.

        Raises:
            InputError: when a column is in no file, or its types cannot be unified across files.
        """
        self.extra_columns.update(extra_columns)
        self.columns = list(dict.fromkeys([*self.columns, *extra_columns.values()]))
        self._check_columns()
        self.schema = self._unified_schema()

    @property
    def no_columns_known(self) -> bool:
        """Whether no file names a column: every file is empty (a 0-byte JSON Lines file), so the input has no
        rows and no schema to check the settings against."""
        return all(not s.num_rows and not s.schema.names for s in self.sources)

    def _unified_schema(self) -> pa.Schema:
        schema = unify_schemas(self.sources, self.columns)
        if self.no_columns_known:  # the columns read are null columns of no rows
            schema = pa.schema([pa.field(c, pa.null()) for c in self.columns])
        return schema

    def _where(self) -> str:
        files = [str(s.path) for s in self.sources]
        return repr(files[0]) if len(files) == 1 else f"any file of {self.path!r}"

    def _check_columns(self) -> None:
        if self.no_columns_known:
            return
        names = self.column_names
        for role, column in (
            ("id_column", self.id_column),
            ("prompt_column", self.prompt_column),
            ("prompt_ids_column", self.prompt_ids_column),
            *self.extra_columns.items(),
        ):
            if column is not None and column not in names:
                raise InputError(
                    f"input.{role} {column!r} is not a column of {self._where()}; its columns are: {', '.join(names)}"
                )
        for column in self.template_columns:
            if column not in names:
                raise InputError(
                    f"input.template field {{{column}}} is not a column of {self._where()}; "
                    f"its columns are: {', '.join(names)}"
                )

    def _check_types(self) -> None:
        schema = self.schema
        if self.prompt_column is not None and self.template is None:
            kind = schema.field(self.prompt_column).type
            if not (is_text_type(kind) or is_binary_type(kind) or pa.types.is_null(kind)):
                raise InputError(f"input.prompt_column {self.prompt_column!r} must hold text, but its type is {kind}")
        if self.prompt_ids_column is not None:
            kind = schema.field(self.prompt_ids_column).type
            if not pa.types.is_null(kind) and (not is_list_type(kind) or not pa.types.is_integer(kind.value_type)):
                raise InputError(
                    f"input.prompt_ids_column {self.prompt_ids_column!r} must be a list of integers, "
                    f"but its type is {kind}"
                )

    def iter_rows(self, done: np.ndarray | None = None) -> Iterator[InputRow]:
        """Yield the rows not marked done, in input order.

        Args:
            done: bool array of length ``num_rows``, True for rows already in the output; None reads every row.
        """
        assert done is None or len(done) == self.num_rows
        first_row = 0
        for source in self.sources:
            if first_row >= self.num_rows:
                return
            end = min(first_row + source.num_rows, self.num_rows)
            skip = np.ones(source.num_rows, dtype=bool)
            skip[: end - first_row] = False if done is None else done[first_row:end]
            if not skip.all():
                present = [c for c in self.columns if c in source.schema.names]
                for row, batch in source.iter_batches(present, self.batch_size, first_row, skip):
                    batch = _with_row_errors(conform_batch(batch, self.schema, self.columns), batch)
                    yield from self._batch_rows(row, batch, skip[row - first_row : row - first_row + batch.num_rows])
            first_row += source.num_rows

    def read_span(self, start: int, end: int) -> Iterator[pa.RecordBatch]:
        """The rows ``start .. end-1`` as record batches, reading only the row groups they are in.

        A batch holds ``columns`` in the unified ``schema``, ``ROW_ERROR_COLUMN`` (null where the row was read)
        and ``ROW_INDEX_COLUMN`` (int64: the row's index in the whole input), so ``rows_of`` can make the rows
        anywhere, e.g. in a Ray replica (``jobs.run.ray_input``).
        """
        first_row = 0
        for source in self.sources:
            last_row = first_row + source.num_rows
            if first_row < end and start < last_row:
                skip = np.ones(source.num_rows, dtype=bool)
                skip[max(start - first_row, 0) : end - first_row] = False
                present = [c for c in self.columns if c in source.schema.names]
                for row, batch in source.iter_batches(present, self.batch_size, first_row, skip):
                    wanted = np.flatnonzero(~skip[row - first_row : row - first_row + batch.num_rows])
                    if len(wanted):  # a contiguous run: the span is one range
                        yield self._span_batch(batch.slice(int(wanted[0]), len(wanted)), row + int(wanted[0]))
            first_row = last_row

    def _span_batch(self, read: pa.RecordBatch, first_row: int) -> pa.RecordBatch:
        conformed = conform_batch(read, self.schema, self.columns)
        errors = (
            read.column(ROW_ERROR_COLUMN)
            if ROW_ERROR_COLUMN in read.schema.names
            else pa.nulls(read.num_rows, pa.string())
        )
        indices = pa.array(np.arange(first_row, first_row + read.num_rows), pa.int64())
        return pa.RecordBatch.from_arrays(
            [*conformed.columns, errors, indices], names=[*self.columns, ROW_ERROR_COLUMN, ROW_INDEX_COLUMN]
        )

    def rows_of(self, batch: pa.RecordBatch | pa.Table) -> Iterator[InputRow]:
        """The input rows of a batch from ``read_span`` (any rows, in any order: each carries its row index)."""
        names = [*self.columns, ROW_ERROR_COLUMN]
        values = {name: _column_values(batch.column(name)) for name in names}
        for i, row_index in enumerate(batch.column(ROW_INDEX_COLUMN).to_pylist()):
            yield self._make_row(row_index, {name: column[i] for name, column in values.items()})

    def _batch_rows(self, first_row: int, batch: pa.RecordBatch, skip: np.ndarray) -> Iterator[InputRow]:
        names = self.columns + ([ROW_ERROR_COLUMN] if ROW_ERROR_COLUMN in batch.schema.names else [])
        values = {name: _column_values(batch.column(name)) for name in names}
        for i in np.flatnonzero(~skip):
            yield self._make_row(first_row + int(i), {name: column[i] for name, column in values.items()})

    def _make_row(self, row_index: int, values: dict[str, Any]) -> InputRow:
        row = InputRow(row_index=row_index, id=str(row_index))
        try:
            if values.get(ROW_ERROR_COLUMN) is not None:  # a JSON Lines row that could not be read (jsonl_source)
                if self.id_column is not None and isinstance(values[self.id_column], str):
                    row.id = values[self.id_column]
                raise ValueError(values[ROW_ERROR_COLUMN])
            if self.id_column is not None:
                row.id = self._text(values[self.id_column], f"id column {self.id_column!r}", allow_empty=True)
            if self.prompt_ids_column is not None:
                row.prompt_token_ids = self._token_ids(values[self.prompt_ids_column])
            elif self.template is not None:
                row.prompt = self._fill_template(values)
            elif self.prompt_column is not None:
                row.prompt = self._text(values[self.prompt_column], f"prompt column {self.prompt_column!r}")
            for role, column in self.extra_columns.items():
                if isinstance(values[column], _Undecodable):
                    raise ValueError(f"{role} {column!r} cannot be read: {values[column].reason}")
                row.extra[role] = values[column]
            for column, name in self.setting_of_column.items():
                if values[column] is not None:
                    row.sampling_overrides[name] = coerce_sampling_value(
                        name, _readable(column, values[column]), column
                    )
            if self.samples_column is not None and values[self.samples_column] is not None:
                row.num_samples = coerce_num_samples(
                    _readable(f"{NUM_SAMPLES_COLUMN} (samples per row)", values[self.samples_column]),
                    NUM_SAMPLES_COLUMN,
                )
        except ValueError as exc:
            row.error = f"row {row_index} (id {row.id!r}): {exc}"
            # NOTE: an error row still carries its readable extra columns (e.g. output.keep_columns)
            row.extra = {
                role: values[column]
                for role, column in self.extra_columns.items()
                if not isinstance(values[column], _Undecodable)
            }
        return row

    @staticmethod
    def _text(value: Any, what: str, allow_empty: bool = False) -> str:
        if value is None:
            raise ValueError(f"{what} is null")
        if isinstance(value, _Undecodable):
            raise ValueError(f"{what} cannot be read: {value.reason}")
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{what} is not valid UTF-8 text ({exc.reason} at byte {exc.start})") from None
        text = str(value)
        if not text and not allow_empty:
            raise ValueError(f"{what} is empty")
        return text

    def _fill_template(self, values: dict[str, Any]) -> str:
        fields_ = {}
        for name in self.template_columns:
            value = values[name]
            if value is None:
                raise ValueError(f"template field {{{name}}} is null")
            if isinstance(value, _Undecodable | bytes):
                value = self._text(value, f"template field {{{name}}}", allow_empty=True)
            fields_[name] = value
        try:
            prompt = self.template.format_map(fields_)
        except (KeyError, IndexError, AttributeError, ValueError, TypeError) as exc:
            raise ValueError(f"template cannot be filled in: {type(exc).__name__}: {exc}") from None
        if not prompt:
            raise ValueError("the filled-in template is empty")
        return prompt

    def _token_ids(self, value: Any) -> list[int]:
        what = f"prompt_ids column {self.prompt_ids_column!r}"
        if value is None:
            raise ValueError(f"{what} is null")
        if not value:
            raise ValueError(f"{what} is empty")
        if any(t is None for t in value):
            raise ValueError(f"{what} holds a null token id")
        if any(t < 0 for t in value):
            raise ValueError(f"{what} holds a negative token id")
        return [int(t) for t in value]


def _with_row_errors(conformed: pa.RecordBatch, read: pa.RecordBatch) -> pa.RecordBatch:
    """``conformed`` with the row-error column of the batch as read, when its source gives one (JSON Lines)."""
    if ROW_ERROR_COLUMN not in read.schema.names:
        return conformed
    return conformed.append_column(ROW_ERROR_COLUMN, read.column(ROW_ERROR_COLUMN))


def _column_values(array: pa.Array) -> list[Any]:
    """``array.to_pylist()``, but a value that cannot be converted becomes ``_Undecodable`` instead of failing all."""
    try:
        return array.to_pylist()
    except (UnicodeDecodeError, pa.ArrowException, ValueError, OverflowError):
        values = []
        for i in range(len(array)):
            try:
                values.append(array[i].as_py())
            except (UnicodeDecodeError, pa.ArrowException, ValueError, OverflowError) as exc:
                values.append(_Undecodable(f"{type(exc).__name__}: {exc}"))
        return values


def _readable(what: str, value: Any) -> Any:
    """``value``, or a ``ValueError`` naming ``what`` when pyarrow could not turn it into a Python object."""
    if isinstance(value, _Undecodable):
        raise ValueError(f"{what} cannot be read: {value.reason}")
    return value


def _setting_columns(names: list[str]) -> dict[str, str]:
    """{column: sampling setting} of the columns named like a per-row setting, by our name or vLLM's.

    Raises:
        InputError: when two columns set the same setting (e.g. ``max_tokens`` and ``max_new_tokens``).
    """
    found: dict[str, str] = {}
    for name in names:
        setting = canonical_name(name)
        if setting not in SAMPLING_FIELDS:
            continue
        other = next((c for c, s in found.items() if s == setting), None)
        if other is not None:
            raise InputError(
                f"columns {other!r} and {name!r} both set {setting} per row; keep one, or set "
                f"input.per_row_settings = false"
            )
        found[name] = setting
    return found


def _type_fits(annotation: str, kind: pa.DataType) -> bool:
    """Whether an Arrow column type can hold values of a SamplingParams field's type (``coerce_sampling_value``
    still checks each value: 2.5 in a float column is no ``top_k``)."""
    annotation = annotation.replace(" | None", "")
    if pa.types.is_null(kind):
        return True
    number = pa.types.is_integer(kind) or pa.types.is_floating(kind)
    text = is_text_type(kind)
    is_list = is_list_type(kind)
    return {
        "int": number,
        "float": number,
        "bool": pa.types.is_boolean(kind),
        "str": text,
        "tuple[int, ...]": is_list and pa.types.is_integer(kind.value_type),
        "tuple[str, ...]": text or (is_list and is_text_type(kind.value_type)),
    }.get(annotation, True)
