"""The schema union of an input's files, and record batches read in it.

The files of one input are read as one table whose schema is the union of theirs (``unify_schemas``): a column
missing from a file is null in its rows, a column whose types differ is read in the type both widen to (int32 and
int64 as int64, a column of Arrow type ``null`` as the other files' type), and a dictionary-encoded column (pandas
categoricals) as its values' type. Every source kind goes through the same step (``conform_batch``), so a new input
format only has to give its files' schemas and record batches.
"""

from __future__ import annotations

import pyarrow as pa

from cbrun.jobs.input.errors import InputError


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
