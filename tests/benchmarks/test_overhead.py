"""``cbrun bench --workload engine-overhead`` on a few requests: the phases add up to the host time of a step."""

import json

import pytest

from cbrun.bench import cli


def test_engine_overhead_table_and_json(tmp_path, capsys):
    out, md = tmp_path / "overhead.json", tmp_path / "overhead.md"
    assert (
        cli.main(
            [
                "--workload",
                "engine-overhead",
                "--running",
                "4,8",
                "--waves",
                "2",
                "--new-tokens",
                "4",
                "--prompt-len",
                "20",
                "--prefill-tokens",
                "16",
                "--skip",
                "1",
                "--decode-steps",
                "3",
                "--repeats",
                "2",
                "--json",
                str(out),
                "--output",
                str(md),
            ]
        )
        == 0
    )
    assert "| scenario | running | steps |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["scenario"], r["running"]) for r in rows] == [("mixed", 4), ("mixed", 8), ("decode", 4), ("decode", 8)]
    assert len(report["runs"]) == 2 and all(r["repeats"] == 2 for r in rows)
    for r in rows:
        assert r["steps"] > 0 and 1 <= r["scheduled_per_step"] <= r["running"]
        assert r["host_us"] == pytest.approx(r["step_us"] - r["forward_us"])
        parts = r["schedule_us"] + r["prepare_us"] + r["read_us"] + r["other_us"]
        assert parts == pytest.approx(r["host_us"])
        assert min(r["schedule_us"], r["prepare_us"], r["read_us"], r["forward_us"]) > 0
        split = r["schedule_us_per_request"] + r["prepare_us_per_request"] + r["read_us_per_request"]
        assert 0 < split < r["host_us_per_request"]
    for r in rows[2:]:  # decode: every step decodes every request, for exactly --decode-steps steps
        assert r["steps"] == 3 and r["scheduled_per_step"] == r["running"]
    text = md.read_text()
    assert text.startswith("# Engine overhead") and "| decode | 8 |" in text and "--repeats 2" in text
