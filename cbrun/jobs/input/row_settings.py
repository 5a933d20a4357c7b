"""Per-row settings: the input columns that set a sampling setting, or the number of samples, for their row.

A column named like a sampling setting (or its vLLM name, e.g. ``max_tokens``), or ``n``, sets it for its row; the
reader (``cbrun.jobs.input.reader.PromptReader``) names these columns once at start, and ``per_row_settings=False`` reads
none. Each value is checked per row (``cbrun.engine.sampling_params.coerce_sampling_value``): a bad one is that row's error.
"""

from __future__ import annotations

import pyarrow as pa

from cbrun.engine.sampling_params import SAMPLING_FIELDS, canonical_name
from cbrun.jobs.input.arrow_types import is_list_type, is_text_type
from cbrun.jobs.input.errors import InputError

#: The optional input column that gives a row its own number of samples (overrides the job's ``sampling.n``).
NUM_SAMPLES_COLUMN = "n"


def setting_columns(names: list[str]) -> dict[str, str]:
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


def type_fits(annotation: str, kind: pa.DataType) -> bool:
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
