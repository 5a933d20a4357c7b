"""Which Arrow column types the job reads as text or as lists, whatever layout the writer chose."""

from __future__ import annotations

import pyarrow as pa


def is_text_type(kind: pa.DataType) -> bool:
    """Whether ``kind`` holds text: ``string``, ``large_string`` or ``string_view`` (newer pyarrow, polars and
    duckdb write the last)."""
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def is_binary_type(kind: pa.DataType) -> bool:
    """Whether ``kind`` holds bytes: ``binary``, ``large_binary`` or ``binary_view``."""
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind)


def is_list_type(kind: pa.DataType) -> bool:
    """Whether ``kind`` is a variable-size list: ``list``, ``large_list``, ``list_view`` or ``large_list_view``."""
    return (
        pa.types.is_list(kind)
        or pa.types.is_large_list(kind)
        or pa.types.is_list_view(kind)
        or pa.types.is_large_list_view(kind)
    )
