"""`cbrun bench` end to end on a tiny workload: the table and JSON come out and every backend equals cbrun."""

import json

from jobs import bench


def test_bench_tiny_workload_writes_table_and_json(stories260k_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = bench.main(["--workload", "gsm8k-stories260k", "--rows", "8", "--max-new-tokens", "4:12",
                       "--backends", "cbrun,cbrun-static,hf-generate", "--batch-sizes", "4",
                       "--model-dir", str(stories260k_dir), "--json", str(out), "--no-isolate"])
    assert code == 0
    table = capsys.readouterr().out
    assert "| backend |" in table and "outputs == cbrun" in table
    assert "yes (8/8)" in table and "NO:" not in table

    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["backend"], r["setting"]) for r in rows] == [
        ("cbrun", ""), ("cbrun-static", "batch 4"), ("hf-generate", "batch 4")]
    for row in rows:
        assert row["rows"] == 8 and row["generated_tokens"] > 0 and row["wall_s"] > 0
        assert row["ttft_s"] is not None and row["vs_cbrun"] > 0
        assert row["rss_peak_mib"] is None  # in-process: no per-backend peak memory
    assert rows[0]["rows_equal"] is None  # cbrun is the reference
    assert all(r["rows_equal"] == 8 and r["rows_differing"] == 0 for r in rows[1:])
    assert rows[1]["generated_tokens"] == rows[0]["generated_tokens"] == rows[2]["generated_tokens"]


def test_cut_output_keeps_stop_token_and_limit():
    assert bench.cut_output([5, 6, 1, 7], 10, (1,)) == [5, 6, 1]
    assert bench.cut_output([5, 6, 1, 7], 2, (1,)) == [5, 6]
    assert bench.cut_output([5, 6, 0, 0], 4, (1,)) == [5, 6, 0, 0]


def test_unimplemented_workload_is_a_setup_error(tmp_path):
    assert bench.main(["--workload", "gsm8k-fewshot", "--rows", "2"]) == 2
