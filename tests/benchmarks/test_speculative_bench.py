"""``cbrun bench --workload speculative`` on a tiny run: the table, the JSON and the README block come out, ngram's
outputs and token counts equal off's, and so do draft's (the target as its own draft)."""

import json

from cbrun.bench import cli, speculative


def test_speculative_bench_writes_report_json_and_readme(stories260k_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(speculative.STORY_REQUESTS, 2, 2)
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{speculative.README_START}\nold table\n{speculative.README_END}\nafter\n")
    out, data = tmp_path / "results.md", tmp_path / "rows.json"
    assert (
        cli.main(
            [
                "--workload",
                "speculative",
                "--batches",
                "2",
                "--workloads",
                "story-repeat",
                "--repeats",
                "1",
                "--modes",
                "off,ngram,draft",
                "--model-dir",
                str(stories260k_dir),
                "--out",
                str(out),
                "--readme",
                str(readme),
                "--json",
                str(data),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| story-repeat | 2 | 2 | ngram |" in printed and out.read_text().strip() == printed.strip()
    rows = {r["mode"]: r for r in json.loads(data.read_text())["rows"]}
    ngram = rows["ngram"]
    assert ngram["outputs_equal"] and ngram["counts_equal"] and ngram["generated"] == rows["off"]["generated"] > 0
    assert ngram["steps"] < rows["off"]["steps"] and 0 < ngram["acceptance"] <= 1 and ngram["vs_off"] > 0
    draft = rows["draft"]  # stories260K as its own draft: every proposal accepted
    assert draft["outputs_equal"] and draft["counts_equal"] and draft["acceptance"] == 1.0
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old table" not in text
    assert "| story-repeat | 2 | ngram |" in text and "| story-repeat | 2 | draft |" in text


def test_engine_settings_reach_every_run_and_the_report():
    settings = speculative.parse_settings(["speculative_row_cost=0.03", "num_speculative_tokens=8"])
    assert settings == {"speculative_row_cost": 0.03, "num_speculative_tokens": 8}
    config = speculative.mode_config("ngram", 8, None, settings)
    assert (config.speculative_row_cost, config.num_speculative_tokens, config.max_requests_per_batch) == (0.03, 8, 8)
    text = speculative._settings_text(settings)
    assert "`num_speculative_tokens` 8" in text and "`speculative_row_cost` 0.03" in text
    assert "`speculative_max_batch` 16" in text
