"""Arrow column values as Python values, one value at a time where pyarrow cannot convert a whole column.

A value pyarrow cannot turn into a Python object (e.g. bytes that are not UTF-8 in a text column) becomes
``Undecodable``, so that it fails only its own row (``readable``), not the whole batch.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa


class Undecodable:
    """Stands in for a value pyarrow could not turn into a Python object."""

    def __init__(self, reason: str):
        self.reason = reason


def column_values(array: pa.Array) -> list[Any]:
    """``array.to_pylist()``, but a value that cannot be converted becomes ``Undecodable`` instead of failing all."""
    try:
        return array.to_pylist()
    except (UnicodeDecodeError, pa.ArrowException, ValueError, OverflowError):
        values = []
        for i in range(len(array)):
            try:
                values.append(array[i].as_py())
            except (UnicodeDecodeError, pa.ArrowException, ValueError, OverflowError) as exc:
                values.append(Undecodable(f"{type(exc).__name__}: {exc}"))
        return values


def readable(what: str, value: Any) -> Any:
    """``value``, or a ``ValueError`` naming ``what`` when pyarrow could not turn it into a Python object."""
    if isinstance(value, Undecodable):
        raise ValueError(f"{what} cannot be read: {value.reason}")
    return value
