"""Input columns carried into every output row (``[output] keep_columns``, ``--keep-column``).

The reader reads a kept column under the role ``keep_column:NAME`` into ``InputRow.extra``; the job hands the
values of a row to each of its output rows (``OutputRow.carried``), and the writer stores them after the output
columns with the input's Arrow type, so an ``answer`` or ``source_id`` column sits beside each completion.
OpenAI batch input adds derived columns the same way (``cbrun.jobs.input.openai_batch.OPENAI_FIELDS``).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.reader import InputRow
from cbrun.jobs.output.writer import OUTPUT_SCHEMA

KEEP_ROLE = "keep_column:"


def keep_role(name: str) -> str:
    """The reader role (``InputRow.extra`` key) of the kept column ``name``."""
    return KEEP_ROLE + name


def keep_roles(columns: list[str]) -> dict[str, str]:
    """{role: column} of the kept columns, for ``PromptReader(extra_columns=...)``."""
    return {keep_role(name): name for name in columns}


def carried_values(row: InputRow) -> dict[str, Any]:
    """{column: value} of a row's carried columns, read from its ``extra``."""
    return {role[len(KEEP_ROLE) :]: value for role, value in row.extra.items() if role.startswith(KEEP_ROLE)}


def check_kept_columns(columns: list[str], input_columns: list[str] | None) -> None:
    """Raise ``InputError`` when a kept column clashes with an output column or is not an input column
    (``input_columns`` None: the input names no column, being empty, so only the clashes are checked)."""
    clashes = [name for name in columns if name in OUTPUT_SCHEMA.names]
    if clashes:
        raise InputError(
            f"output.keep_columns {clashes[0]!r} clashes with the output column of the same name; "
            f"output columns: {', '.join(OUTPUT_SCHEMA.names)}"
        )
    for name in columns:
        if input_columns is not None and name not in input_columns:
            raise InputError(
                f"output.keep_columns {name!r} is not an input column; input columns: {', '.join(input_columns)}"
            )


def carried_fields(columns: list[str], schema: pa.Schema, derived: list[pa.Field] = ()) -> list[pa.Field]:
    """The Arrow fields the output gains: the kept input columns in their type in ``schema`` (the input's, unified
    across files), then the ``derived`` fields not already kept; all nullable (an error row may lack a value)."""
    kept = set(columns)
    return [pa.field(name, schema.field(name).type) for name in columns] + [f for f in derived if f.name not in kept]
