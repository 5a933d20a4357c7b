"""Stream prompt rows out of an input's files in record batches: ``PromptReader`` and the ``InputRow`` it yields.

The input is never loaded whole: its files (``cbrun.jobs.input.discovery``) are read as sources (``cbrun.jobs.input.sources``) in
record batches over only the columns the job needs, in the union of the files' schemas (``cbrun.jobs.input.schema_union``),
and rows that are done already (resume) are not read. Each row keeps its ``row_index``, its position in the whole
input (files in sorted order), which is stable across runs and is the key the output and the resume bitmap use.

Setup problems (a missing file, a column in no file, a column of the wrong type, columns whose types cannot be
unified) raise before any row is read; problems of one row (a null or empty prompt, a null template field, bytes
that are not UTF-8, a bad per-row sampling value) become that row's ``error`` and the job goes on.

Per-row settings (``cbrun.jobs.input.row_settings``): a column named like a sampling setting, or ``n``, sets it for its
row; ``per_row_settings=False`` reads none.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from cbrun.engine.sampling_params import SAMPLING_FIELD_TYPES, coerce_num_samples, coerce_sampling_value
from cbrun.jobs.input.arrow_types import is_binary_type, is_list_type, is_text_type
from cbrun.jobs.input.discovery import list_input_files
from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.formats import ROW_ERROR_COLUMN, InputSource
from cbrun.jobs.input.row_settings import NUM_SAMPLES_COLUMN, setting_columns, type_fits
from cbrun.jobs.input.row_values import Undecodable, column_values, readable
from cbrun.jobs.input.schema_union import conform_batch, unify_schemas
from cbrun.jobs.input.sources import open_source

logger = logging.getLogger("cbrun.reader")

#: The column of ``PromptReader.read_span`` batches that holds each row's index in the whole input.
ROW_INDEX_COLUMN = "__cbrun_row_index__"


@dataclass(frozen=True, slots=True)
class RowPlace:
    """Where a row is in its input file, for messages: the source's ``row_place`` (JSON Lines: ``line 5 of
    prompts.jsonl``), else ``row 3 of part-1.parquet``. Said only when a message needs it (``str``): a JSON Lines
    file finds its line numbers by reading itself once more.

    Attributes:
        source: the row's file.
        row: the row's index in that file, counting from 0.
    """

    source: InputSource
    row: int

    def __str__(self) -> str:
        describe = getattr(self.source, "row_place", None)
        if describe is not None:
            return describe(self.row)
        return f"row {self.row} of {str(self.source.path).rstrip('/').rsplit('/', 1)[-1]}"


def row_where(row_index: int, row_id: str, place: RowPlace | None = None, id_name: str = "id") -> str:
    """How a message names a row: ``row 3 (id 'a', line 5 of prompts.jsonl)``; without a place ``row 3 (id 'a')``.

    Args:
        id_name: what the id is called (``custom_id`` for OpenAI batch requests).
    """
    return f"row {row_index} ({id_name} {row_id!r}{'' if place is None else f', {place}'})"


@dataclass
class InputRow:
    """One input row, ready to become a request (or an error row).

    Attributes:
        row_index: position of the row in the whole input, counting from 0.
        id: the row's id as a string (the id column's value, else the row index).
        place: where the row is in its file, when the file has its own way of saying it (a JSON Lines line) or the
            input has several files; None: ``row_index`` says it.
        prompt: the prompt text (from the prompt column or the filled-in template); None with a token-id prompt.
        prompt_token_ids: the prompt as token ids, when read from ``prompt_ids_column``.
        sampling_overrides: per-row sampling settings from columns named like SamplingParams fields (nulls left out).
        extra: {role: value} of the reader's ``extra_columns`` (e.g. candidates, messages), as read; the job
            checks them.
        num_samples: the row's ``n`` column (samples to generate, >= 1); None: the job's ``sampling.n``.
        error: why the row cannot run, naming the row (``where``) and the cause; None for a good row.
    """

    row_index: int
    id: str
    # NOTE: not compared: two readers of one file make equal rows
    place: RowPlace | None = field(default=None, compare=False, repr=False)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    num_samples: int | None = None
    error: str | None = None

    def where(self, id_name: str = "id") -> str:
        """How a message names the row (``row_where``): ``row 3 (id 'a', line 5 of prompts.jsonl)``."""
        return row_where(self.row_index, self.id, self.place, id_name)


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
        endpoint_url: str | None = None,
    ):
        self.path = str(path)
        self.prompt_column = prompt_column
        self.prompt_ids_column = prompt_ids_column
        self.id_column = id_column
        self.template = template
        self.batch_size = batch_size
        # {role: column}, e.g. {"candidates_column": "answers"}: read into InputRow.extra, checked by the job.
        self.extra_columns = dict(extra_columns or {})
        kind, files = list_input_files(path, endpoint_url)
        # json_text_fields: JSON Lines fields read as JSON text (an OpenAI batch request's body; see jobs.input.formats.jsonl)
        self.sources = [open_source(kind, f, json_text_fields, endpoint_url) for f in files]
        self.column_names = list(dict.fromkeys(name for source in self.sources for name in source.schema.names))
        self.num_input_rows = sum(s.num_rows for s in self.sources)
        #: each source's first row in the whole input (a row's place: ``_place``)
        self._first_rows = list(itertools.accumulate((s.num_rows for s in self.sources[:-1]), initial=0))
        self.num_rows = self.num_input_rows if limit is None else min(limit, self.num_input_rows)
        self.template_columns = template_fields(template) if template is not None else []
        self.setting_of_column = setting_columns(self.column_names) if per_row_settings else {}
        self.sampling_columns = list(self.setting_of_column)
        self.samples_column = (
            NUM_SAMPLES_COLUMN if per_row_settings and NUM_SAMPLES_COLUMN in self.column_names else None
        )
        self.columns = self._columns_read()
        self._check_columns()
        self.schema = self._unified_schema()
        self._check_types()
        self._report_setting_columns()

    def _columns_read(self) -> list[str]:
        """The input columns the reader reads: the id, the prompt's, the per-row settings' and the extra ones."""
        wanted = [
            self.id_column,
            self.prompt_column,
            self.prompt_ids_column,
            *self.template_columns,
            *self.sampling_columns,
            self.samples_column,
            *self.extra_columns.values(),
        ]
        return list(dict.fromkeys(c for c in wanted if c is not None))

    def _report_setting_columns(self) -> None:
        """Log the columns read as per-row settings; warn about one whose type cannot hold its setting."""
        named = [*self.sampling_columns, *([self.samples_column] if self.samples_column else [])]
        if named:
            logger.info(
                "per-row settings from columns: %s (input.per_row_settings = false reads them as data)",
                ", ".join(named),
            )
        for column in named:
            setting = self.setting_of_column.get(column, NUM_SAMPLES_COLUMN)
            kind = self.schema.field(column).type
            if not type_fits(SAMPLING_FIELD_TYPES.get(setting, "int"), kind):
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
        anywhere, e.g. in a Ray replica (``cbrun.jobs.run.ray_executor.PendingRowsDatasource``).
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
        values = {name: column_values(batch.column(name)) for name in names}
        for i, row_index in enumerate(batch.column(ROW_INDEX_COLUMN).to_pylist()):
            yield self._make_row(row_index, {name: column[i] for name, column in values.items()})

    def _batch_rows(self, first_row: int, batch: pa.RecordBatch, skip: np.ndarray) -> Iterator[InputRow]:
        names = self.columns + ([ROW_ERROR_COLUMN] if ROW_ERROR_COLUMN in batch.schema.names else [])
        values = {name: column_values(batch.column(name)) for name in names}
        for i in np.flatnonzero(~skip):
            yield self._make_row(first_row + int(i), {name: column[i] for name, column in values.items()})

    def _place(self, row_index: int) -> RowPlace | None:
        """The row's ``RowPlace``, or None where its row index alone says where it is (one file that has no
        ``row_place`` of its own, such as a single Parquet file)."""
        i = bisect.bisect_right(self._first_rows, row_index) - 1
        source = self.sources[i]
        if len(self.sources) == 1 and not hasattr(source, "row_place"):
            return None
        return RowPlace(source, row_index - self._first_rows[i])

    def _make_row(self, row_index: int, values: dict[str, Any]) -> InputRow:
        row = InputRow(row_index=row_index, id=str(row_index), place=self._place(row_index))
        try:
            if values.get(ROW_ERROR_COLUMN) is not None:  # a JSON Lines row that could not be read (formats.jsonl)
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
                if isinstance(values[column], Undecodable):
                    raise ValueError(f"{role} {column!r} cannot be read: {values[column].reason}")
                row.extra[role] = values[column]
            for column, name in self.setting_of_column.items():
                if values[column] is not None:
                    row.sampling_overrides[name] = coerce_sampling_value(name, readable(column, values[column]), column)
            if self.samples_column is not None and values[self.samples_column] is not None:
                row.num_samples = coerce_num_samples(
                    readable(f"{NUM_SAMPLES_COLUMN} (samples per row)", values[self.samples_column]),
                    NUM_SAMPLES_COLUMN,
                )
        except ValueError as exc:
            row.error = f"{row.where()}: {exc}"
            # NOTE: an error row still carries its readable extra columns (e.g. output.keep_columns)
            row.extra = {
                role: values[column]
                for role, column in self.extra_columns.items()
                if not isinstance(values[column], Undecodable)
            }
        return row

    @staticmethod
    def _text(value: Any, what: str, allow_empty: bool = False) -> str:
        if value is None:
            raise ValueError(f"{what} is null")
        if isinstance(value, Undecodable):
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
            if isinstance(value, Undecodable | bytes):
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
