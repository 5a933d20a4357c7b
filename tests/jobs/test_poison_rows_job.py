"""Issue 39's poison rows through a job: overflowing penalties finish, a row whose draw has no finite
distribution is an error row naming the cause, every other row is its solo output, and a rerun finishes."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.modes.generate import derive_seed
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import run_job
from tests.engine.test_poison_rows import nan_probabilities_hook

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=256, max_requests_per_batch=8, num_blocks=64)
DEFAULTS = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
MANIFEST_DEFAULTS = {"sampling": DEFAULTS, "id_column": "id"}
POISON_TEMPERATURE = 0.625  # the NaN hook's rows

#: id -> the row's overrides of the job's defaults (temperature 1, seeded per row).
ROWS = {
    "repetition": {"repetition_penalty": 1e-38, "temperature": 0.7},
    "frequency": {"frequency_penalty": -1e33, "temperature": 1.5e-5},
    "greedy": {"temperature": 0.0},
    "sampled": {},
    "penalised": {"temperature": 0.0, "repetition_penalty": 1.3},
}


def write_input(path, rows: dict[str, dict]) -> list[str]:
    prompts = [f"row {name} says" for name in rows]
    columns = {"id": list(rows), "prompt": prompts}
    for setting in ("repetition_penalty", "frequency_penalty", "temperature"):
        columns[setting] = pa.array([overrides.get(setting) for overrides in rows.values()], pa.float64())
    pq.write_table(pa.table(columns), path)
    return prompts


def solo(engine, name: str, prompt: str, overrides: dict) -> list[int]:
    """The row run alone in the engine, with the job's defaults, its overrides and its derived seed."""
    params = DEFAULTS.replace(seed=derive_seed(0, name), **overrides)
    return next(iter(engine.generate([(0, engine.tokenizer.encode(prompt), params)]))).output_token_ids


def outputs(output_dir) -> dict[str, dict]:
    return {row["id"]: row for row in read_output(output_dir).to_pylist()}


def test_overflowing_penalties_finish_in_a_job(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    prompts = write_input(tmp_path / "in.parquet", ROWS)
    summary = run_job(
        make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out"), progress=False, engine=tiny_engine
    )
    assert (summary.exit_code, summary.num_rows, summary.num_errors) == (0, 5, 0)
    out = outputs(tmp_path / "out")
    for (name, overrides), prompt in zip(ROWS.items(), prompts):
        assert out[name]["finish_reason"] == "length" and out[name]["error"] is None, name
        assert out[name]["completion_token_ids"] == solo(tiny_engine, name, prompt, overrides), name


def test_a_non_finite_row_is_an_error_row_and_a_rerun_finishes(
    tiny_model_dir, tiny_engine, tmp_path, make_manifest, monkeypatch
):
    rows = {**ROWS, "poison": {"temperature": POISON_TEMPERATURE}}
    prompts = write_input(tmp_path / "in.parquet", rows)
    manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out")
    manifest.output.max_error_fraction = 0.5
    nan_probabilities_hook(monkeypatch, POISON_TEMPERATURE)
    summary = run_job(manifest, progress=False, engine=tiny_engine)
    assert (summary.exit_code, summary.num_rows, summary.num_errors) == (0, 6, 1)
    out = outputs(tmp_path / "out")
    assert out["poison"]["finish_reason"] == "error"
    assert "non-finite probabilities" in out["poison"]["error"] and "outside the vocabulary" in out["poison"]["error"]
    monkeypatch.undo()
    for (name, overrides), prompt in zip(ROWS.items(), prompts):
        assert out[name]["completion_token_ids"] == solo(tiny_engine, name, prompt, overrides), name
    retried = run_job(manifest, progress=False, engine=tiny_engine, retry_errors=True)
    assert (retried.exit_code, retried.num_errors) == (0, 0)
    again = outputs(tmp_path / "out")
    assert again["poison"]["finish_reason"] == "length"
    assert again["poison"]["completion_token_ids"] == solo(tiny_engine, "poison", prompts[-1], rows["poison"])
