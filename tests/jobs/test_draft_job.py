"""A job with a draft model: `--set engine.draft_model=...` reaches the engine, llama2.c's goldens are unchanged, the
draft is in the job's fingerprint, and a missing draft directory is refused before any work."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.jobs.cli import main
from cbrun.jobs.output.output_dir import read_output


def _short_goldens(reference_greedy):
    return [line for line in reference_greedy if line["max_positions"] <= 128]


def _goldens_input(reference_greedy, tmp_path):
    lines = _short_goldens(reference_greedy)
    table = pa.table(
        {
            "prompt_ids": [line["prompt_token_ids"] for line in lines],
            "max_new_tokens": [line["max_positions"] - len(line["prompt_token_ids"]) + 1 for line in lines],
        }
    )
    pq.write_table(table, tmp_path / "goldens.parquet")
    return tmp_path / "goldens.parquet"


def test_job_with_a_draft_model(stories260k_dir, reference_greedy, tmp_path, capsys):
    source = _goldens_input(reference_greedy, tmp_path)
    out = tmp_path / "out"
    args = [
        "run",
        "--no-progress",
        "--model",
        str(stories260k_dir),
        "--input",
        str(source),
        "--prompt-ids-column",
        "prompt_ids",
        "--output",
        str(out),
        "--set",
        "engine.speculative=draft",
        "--set",
        f"engine.draft_model={stories260k_dir}",
        "--set",
        "engine.max_batch_tokens=64",
    ]
    assert main(args) == 0
    rows = sorted(read_output(out).to_pylist(), key=lambda r: r["row_index"])
    assert len(rows) == len(_short_goldens(reference_greedy)) == 3
    for row, line in zip(rows, _short_goldens(reference_greedy)):
        assert row["completion_token_ids"] == line["output_token_ids"], line["prompt"]
    stats = json.loads((out / "_cbrun" / "stats.json").read_text())["engine_stats"]
    assert stats["num_proposed_tokens"] > 0 and stats["acceptance_rate"] == 1.0  # the draft is the target
    captured = capsys.readouterr()
    assert f"speculative: 100.0% of {stats['num_proposed_tokens']} proposals accepted" in captured.out + captured.err
    job = json.loads((out / "_cbrun" / "job.json").read_text())
    assert job["draft_model"]["path"] == str(stories260k_dir.resolve())
    assert "config.json" in job["draft_model"]["files"]

    # Another draft model is another job (its proposals enter sampled rows' draws).
    other = tmp_path / "other_draft"
    other.mkdir()
    for path in stories260k_dir.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    changed = [a.replace(f"engine.draft_model={stories260k_dir}", f"engine.draft_model={other}") for a in args]
    assert main(changed) == 2
    assert "changed: draft_model.files.config.json, draft_model.path" in capsys.readouterr().err


def test_missing_draft_model_is_refused_before_work(stories260k_dir, reference_greedy, tmp_path, capsys):
    source = _goldens_input(reference_greedy, tmp_path)
    assert (
        main(
            [
                "run",
                "--no-progress",
                "--model",
                str(stories260k_dir),
                "--input",
                str(source),
                "--prompt-ids-column",
                "prompt_ids",
                "--output",
                str(tmp_path / "out"),
                "--set",
                "engine.speculative=draft",
                "--set",
                f"engine.draft_model={tmp_path / 'nope'}",
            ]
        )
        == 2
    )
    assert "engine.draft_model: model directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("part-*"))
