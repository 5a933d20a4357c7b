"""Per-row sampling values coerced to the types SamplingParams declares, every field, nothing passed through."""

from __future__ import annotations

import pytest

from cbrun.engine.sampling_params import SAMPLING_FIELD_TYPES, SamplingParams, coerce_num_samples, coerce_sampling_value
from cbrun.engine.structured_output import StructuredOutputsParams


def test_every_field_has_a_coercion_and_wrong_types_are_refused():
    good = {
        "int": 3.0,
        "float": 2,
        "bool": True,
        "str": "x",
        "tuple[int, ...]": [1, 2],
        "tuple[str, ...]": "END",
        "StructuredOutputsParams": {"regex": "a+", "json": None},
    }  # a Parquet struct: unset fields are null
    want = {
        "int": 3,
        "float": 2.0,
        "bool": True,
        "str": "x",
        "tuple[int, ...]": (1, 2),
        "tuple[str, ...]": ("END",),
        "StructuredOutputsParams": StructuredOutputsParams(regex="a+"),
    }
    bad = {
        "int": "3",
        "float": "0.5",
        "bool": 1,
        "str": 1,
        "tuple[int, ...]": [1, -2],
        "tuple[str, ...]": [1],
        "StructuredOutputsParams": 5,
    }
    for name, kind in SAMPLING_FIELD_TYPES.items():
        kind = kind.removesuffix(" | None")
        value = coerce_sampling_value(name, good[kind])
        assert value == want[kind] and type(value) is type(want[kind]), name
        with pytest.raises(ValueError, match=f"^{name} must be"):
            coerce_sampling_value(name, bad[kind])
    assert coerce_sampling_value("seed", None) is None  # an optional field takes null
    with pytest.raises(ValueError, match="max_new_tokens must be an integer, got None"):
        coerce_sampling_value("max_new_tokens", None)
    with pytest.raises(ValueError, match="unknown sampling setting 'max_tokenz'"):
        coerce_sampling_value("max_tokenz", 3)
    assert set(SAMPLING_FIELD_TYPES) == set(SamplingParams.__dataclass_fields__)
    with pytest.raises(ValueError, match="^column 'max_tokens': max_new_tokens must be an integer"):
        coerce_sampling_value("max_new_tokens", "3", "max_tokens")  # a vLLM-named column


def test_num_samples():
    assert coerce_num_samples(2.0) == 2
    for value in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"^n \(samples per row\) must be an integer >= 1"):
            coerce_num_samples(value)
