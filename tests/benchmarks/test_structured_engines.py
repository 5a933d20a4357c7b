"""``benchmarks.structured_engines``: its per-row schemas are distinct and served by both engines, and its p99."""

from __future__ import annotations

import json

from benchmarks.structured_engines import _p99, distinct_schema
from cbrun.engine.structured_output.schema_support import find_unsupported


def test_distinct_schemas_differ_and_both_engines_enforce_them():
    schemas = [distinct_schema(i) for i in range(40)]
    assert len({json.dumps(s) for s in schemas}) == 40
    for schema in schemas:
        assert find_unsupported(schema) is None
        assert find_unsupported(schema, backend="guidance") is None


def test_p99_is_an_observed_value_near_the_top():
    assert _p99([float(i) for i in range(101)]) == 99.0
    assert _p99([3.0]) == 3.0


def test_median_round_takes_ratios_within_each_round():
    from benchmarks.structured_engines import _median_round

    def rnd(llg: float, free: float) -> dict:
        return {"llguidance": {"tok_s": llg, "tokens": 80, "cpu_s": 1.0},
                "unconstrained, same lengths": {"tok_s": free, "tokens": 100, "cpu_s": 1.0}}  # fmt: skip

    picked = _median_round([rnd(50, 100), rnd(90, 100), rnd(20, 25)])  # ratios 0.5, 0.9, 0.8
    assert picked["llguidance"]["ratio"] == 0.8 and picked["llguidance"]["tok_s"] == 20
    assert picked["llguidance"]["cpu_ratio"] == 0.8
