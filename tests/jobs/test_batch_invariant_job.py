"""``engine.batch_invariant`` in a job: "auto" turns it on for sampled jobs and off for greedy ones, the resolved
mode is recorded in job.json (an output is not continued in the other mode), and an "on" the engine cannot run is
exit 2 naming it."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.jobs.cli import main


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"story {i}" for i in range(4)]}), path)
    return path


def run(tiny_model_dir, prompts, out, *settings) -> int:
    args = ["run", "--no-progress", "--model", str(tiny_model_dir), "--input", str(prompts), "--prompt-column"]
    args += ["text", "--output", str(out), "--max-new-tokens", "4", "--limit", "4"]
    for setting in settings:
        args += ["--set", setting]
    return main(args)


def job_json(out) -> dict:
    return json.loads((out / "_cbrun" / "job.json").read_text())


def test_auto_is_on_for_a_sampled_job_and_off_for_a_greedy_one(tmp_path, prompts, tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="cbrun")
    assert run(tiny_model_dir, prompts, tmp_path / "sampled", "sampling.temperature=0.8") == 0
    assert "batch_invariant on" in caplog.text
    assert job_json(tmp_path / "sampled")["sampling"]["batch_invariant"] is True
    caplog.clear()
    assert run(tiny_model_dir, prompts, tmp_path / "greedy") == 0
    assert "batch_invariant off: no row is sampled" in caplog.text
    assert "batch_invariant" not in job_json(tmp_path / "greedy")["sampling"]
    # the other mode does not continue a sampled output
    assert (
        run(tiny_model_dir, prompts, tmp_path / "sampled", "sampling.temperature=0.8", "engine.batch_invariant=off")
        == 2
    )


@pytest.mark.parametrize(
    ("column", "values", "mode"), [("max_new_tokens", [2, 3, 4, 5], "off"), ("temperature", [0.0, 0.8, 0.0, 0.5], "on")]
)
def test_auto_follows_the_per_row_columns_that_decide_greedy(tmp_path, tiny_model_dir, caplog, column, values, mode):
    """A per-row column of a setting that cannot make a greedy job's row sampled (max_new_tokens) leaves "auto" off;
    a temperature column may sample, so "auto" is on."""
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"story {i}" for i in range(4)], column: values}), path)
    caplog.set_level(logging.INFO, logger="cbrun")
    assert run(tiny_model_dir, path, tmp_path / "out") == 0
    assert f"batch_invariant {mode}" in caplog.text


@pytest.mark.parametrize(
    "settings, named",
    [
        (("engine.batch_invariant=on", "engine.attention_backend=torch"), "engine.batch_invariant = on, but "),
        (("engine.cuda_graphs=on",), "engine.cuda_graphs = on, but "),
    ],
    ids=["batch-invariant", "cuda-graphs"],
)
def test_on_that_cannot_run_is_exit_2_naming_it(tmp_path, prompts, tiny_model_dir, capsys, settings, named):
    """A switch set "on" where it cannot run is refused as the manifest names it (engine.NAME), before any row."""
    assert run(tiny_model_dir, prompts, tmp_path / "o", *settings) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").glob("*.parquet"))
