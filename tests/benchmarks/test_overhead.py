"""``cbrun bench --workload engine-overhead`` on a few requests: the phases add up to the host time of a step."""

import json

import pytest

from benchmarks.cbrun_bench import cli


def test_engine_overhead_table_and_json(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert cli.main(["--workload", "engine-overhead", "--running", "4,8", "--waves", "2", "--new-tokens", "4",
                     "--prompt-len", "20", "--prefill-tokens", "16", "--skip", "1", "--json", str(out)]) == 0
    assert "| running | steps |" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["running"] for r in rows] == [4, 8]
    for r in rows:
        assert r["steps"] > 0 and 1 <= r["scheduled_per_step"] <= r["running"]
        assert r["host_us"] == pytest.approx(r["step_us"] - r["forward_us"])
        parts = r["schedule_us"] + r["prepare_us"] + r["read_us"] + r["other_us"]
        assert parts == pytest.approx(r["host_us"])
        assert min(r["schedule_us"], r["prepare_us"], r["read_us"], r["forward_us"]) > 0
