"""``cbrun bench --workload structured`` on 4 rows: both runs generate the same tokens, every constrained row ends by
stop and validates, and the report holds the grammar's compile and mask times."""

from __future__ import annotations

import re

import pytest

from cbrun.bench import structured
from cbrun.bench.workloads import gsm8k_path


@pytest.mark.skipif(not gsm8k_path("train").is_file(), reason="needs ../shared/data/gsm8k_train.parquet")
def test_structured_bench_reports_both_runs(tmp_path):
    pytest.importorskip("xgrammar")
    out = tmp_path / "report.md"
    args = ["--rows", "4", "--max-new-tokens", "160", "--threads", "1", "--model-dir", str(tmp_path / "m")]
    assert structured.main([*args, "--out", str(out)]) == 0
    report = out.read_text()
    rows = {m[0]: m[1:] for m in re.findall(r"^\| (json schema|unconstrained, same lengths) \| (\d+) \|", report, re.M)}
    assert rows["json schema"] == rows["unconstrained, same lengths"]  # the same tokens generated
    assert "rows that parse and validate (jsonschema): 4 / 4; errors: 0" in report
    assert re.search(r"\| json schema \| .* \| 4 / 4 \|$", report, re.M)  # every row ended by stop
    assert re.search(r"grammar compile \(one schema, on the compile thread\): \d+\.\d+ s", report)
    assert re.search(r"bitmask fill \+ upload per step at up to 4 constrained rows: \d+\.\d+ ms", report)
