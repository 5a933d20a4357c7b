"""Job: bad rows become error rows while the job goes on, per-row seeds, resume and finish, setup errors."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.modes.generate import derive_seed
from cbrun.jobs.output.writer import committed_parts
from cbrun.jobs.run.job import JobError, run_job

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=256, max_requests_per_batch=8, num_blocks=64)
MANIFEST_DEFAULTS = {"sampling": SamplingParams(max_new_tokens=6, temperature=0.0), "commit_every_rows": 3}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def read_output(output_dir) -> dict[int, dict]:
    rows = [row for part in committed_parts(output_dir) for row in pq.read_table(part).to_pylist()]
    by_index = {row["row_index"]: row for row in rows}
    assert len(by_index) == len(rows), "a row index appears twice"
    return by_index


def write_prompts(path, n: int, **extra):
    pq.write_table(pa.table({"prompt": [f"prompt number {i}" for i in range(n)], **extra}), path, row_group_size=4)
    return path


def test_bad_rows_are_error_rows_and_the_job_goes_on(tiny_model_dir, tiny_engine, tokenizer, tmp_path, make_manifest):
    prompts = ["hello", None, "", "x" * 300, "bad temperature", "world"]
    temperature = [None, None, None, None, -1.0, 0.0]
    pq.write_table(
        pa.table(
            {"id": [f"r{i}" for i in range(6)], "prompt": prompts, "temperature": pa.array(temperature, pa.float64())}
        ),
        tmp_path / "in.parquet",
    )
    manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", id_column="id")
    summary = run_job(manifest, progress=False, engine=tiny_engine)
    assert (summary.num_rows, summary.num_errors, summary.num_skipped) == (6, 4, 0)
    out = read_output(tmp_path / "out")
    assert sorted(out) == list(range(6))
    assert out[1]["error"] == "row 1 (id 'r1'): prompt column 'prompt' is null"
    assert out[2]["error"] == "row 2 (id 'r2'): prompt column 'prompt' is empty"
    assert out[3]["error"].startswith("row 3 (id 'r3'): the prompt has 301 tokens")
    assert "maximum length is 256" in out[3]["error"]
    assert out[4]["error"].startswith("row 4 (id 'r4'): temperature must be")
    for i in (1, 2, 3, 4):
        assert out[i]["finish_reason"] == "error" and out[i]["completion"] is None
    for i in (0, 5):
        row = out[i]
        assert row["finish_reason"] in ("stop", "length") and row["error"] is None
        assert row["num_prompt_tokens"] == len(tokenizer.encode(prompts[i]))
        assert row["num_completion_tokens"] == len(row["completion_token_ids"]) <= 6
        assert row["completion"] == tokenizer.decode(row["completion_token_ids"], skip_special_tokens=True)
    assert summary.num_generated_tokens == out[0]["num_completion_tokens"] + out[5]["num_completion_tokens"]
    stats = json.loads((tmp_path / "out" / "_cbrun" / "stats.json").read_text())
    assert stats["num_errors"] == 4 and (tmp_path / "out" / "_SUCCESS").is_file()
    assert summary.line().startswith("cbrun: 6 rows (4 errors, 0 skipped) | ")


def test_prompt_ids_column_is_not_re_encoded(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    ids = pa.array([[10, 20, 30], [99], [5000]], pa.list_(pa.int64()))
    pq.write_table(pa.table({"ids": ids}), tmp_path / "ids.parquet")
    manifest = make_manifest(
        tiny_model_dir, tmp_path / "ids.parquet", tmp_path / "out", prompt_column=None, prompt_ids_column="ids"
    )
    run_job(manifest, progress=False, engine=tiny_engine)
    out = read_output(tmp_path / "out")
    assert [out[i]["num_prompt_tokens"] for i in (0, 1)] == [3, 1]
    assert "token id 5000 is out of the model's vocabulary" in out[2]["error"]


def test_resume_extends_and_finished_job_does_nothing(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    write_prompts(tmp_path / "in.parquet", 10)
    full = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "full")
    run_job(full, progress=False, engine=tiny_engine)
    reference = read_output(tmp_path / "full")

    part = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", limit=4)
    assert run_job(part, progress=False, engine=tiny_engine).num_rows == 4
    (tmp_path / "out" / ".part-000009.parquet.tmp").write_bytes(b"left by a killed run")
    part.input.limit = None  # the limit is not part of the fingerprint: raising it extends the job
    summary = run_job(part, progress=False, engine=tiny_engine)
    assert (summary.num_rows, summary.num_skipped) == (6, 4)
    assert not (tmp_path / "out" / ".part-000009.parquet.tmp").exists()
    out = read_output(tmp_path / "out")
    assert {i: r["completion_token_ids"] for i, r in out.items()} == {
        i: r["completion_token_ids"] for i, r in reference.items()
    }

    again = run_job(part, progress=False, engine=tiny_engine)
    assert again.already_finished and again.num_rows == 0 and again.num_skipped == 10
    assert "already finished" in again.line()


def test_changed_fingerprint_refuses_unless_overwrite(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    write_prompts(tmp_path / "in.parquet", 3)
    manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out")
    run_job(manifest, progress=False, engine=tiny_engine)
    manifest.sampling = manifest.sampling.replace(max_new_tokens=3)
    with pytest.raises(JobError, match="sampling.max_new_tokens"):
        run_job(manifest, progress=False, engine=tiny_engine)
    manifest.output.overwrite = True
    summary = run_job(manifest, progress=False, engine=tiny_engine)
    assert summary.num_rows == 3 and summary.num_skipped == 0
    assert all(r["num_completion_tokens"] <= 3 for r in read_output(tmp_path / "out").values())


def test_seeded_sampling_is_reproducible_and_seed_column_overrides(
    tiny_model_dir, tiny_engine, tmp_path, make_manifest
):
    assert derive_seed(0, "a") == derive_seed(0, "a") != derive_seed(1, "a") != derive_seed(0, "b")
    assert 0 <= derive_seed(123, "row") < 2**63
    pq.write_table(
        pa.table({"prompt": ["same prompt"] * 4, "seed": pa.array([None, None, 42, 42], pa.int64())}),
        tmp_path / "in.parquet",
    )
    outputs = []
    for name in ("a", "b"):
        manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / name)
        manifest.sampling = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
        run_job(manifest, progress=False, engine=tiny_engine)
        outputs.append({i: r["completion_token_ids"] for i, r in read_output(tmp_path / name).items()})
    assert outputs[0] == outputs[1]  # same job seed: same samples, whatever the batching
    assert outputs[0][0] != outputs[0][1]  # rows 0 and 1 get seeds derived from their different ids
    assert outputs[0][2] == outputs[0][3]  # rows 2 and 3 both take seed 42 from the seed column


def test_logprobs_reach_the_output(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    write_prompts(tmp_path / "in.parquet", 2)
    manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out")
    manifest.sampling = SamplingParams(max_new_tokens=4, logprobs=2, prompt_logprobs_from=1)
    run_job(manifest, progress=False, engine=tiny_engine)
    for row in read_output(tmp_path / "out").values():
        assert len(row["logprobs"]) == row["num_completion_tokens"]
        assert all(2 <= len(step) <= 3 for step in row["logprobs"])
        assert len(row["prompt_logprobs"]) == len(row["prompt_greedy"]) == row["num_prompt_tokens"] - 1


def test_stop_string_column_cuts_the_completion(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    write_prompts(tmp_path / "in.parquet", 1)
    manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "free")
    manifest.sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    run_job(manifest, progress=False, engine=tiny_engine)
    text = read_output(tmp_path / "free")[0]["completion"]
    cut = next((k for k in range(1, len(text)) if text[k].isalnum() and text[k] not in text[:k]), None)
    if cut is None:
        pytest.skip(f"no usable stop character in {text!r}")
    write_prompts(tmp_path / "stop.parquet", 1, stop=[text[cut]])
    manifest.input.path, manifest.output.path = str(tmp_path / "stop.parquet"), str(tmp_path / "out")
    run_job(manifest, progress=False, engine=tiny_engine)
    row = read_output(tmp_path / "out")[0]
    assert (row["completion"], row["finish_reason"]) == (text[:cut], "stop")


def test_setup_errors_come_before_any_work(tiny_model_dir, tmp_path, make_manifest):
    write_prompts(tmp_path / "in.parquet", 2)
    manifest = make_manifest(tmp_path / "no-model", tmp_path / "in.parquet", tmp_path / "out")
    with pytest.raises(JobError, match="model directory .* not found"):
        run_job(manifest, progress=False)
    manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", prompt_column="question")
    with pytest.raises(JobError, match="'question' is not a column"):
        run_job(manifest, progress=False)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    manifest = make_manifest(tmp_path / "broken", tmp_path / "in.parquet", tmp_path / "out")
    with pytest.raises(JobError, match="cannot load the model"):
        run_job(manifest, progress=False)
    assert not (tmp_path / "out").exists()


def test_corrupt_weights_are_a_setup_error(tiny_model_dir, tmp_path, make_manifest):
    """A truncated model.safetensors (an interrupted download) is refused like any bad input, not a traceback."""
    import shutil

    write_prompts(tmp_path / "in.parquet", 2)
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    manifest = make_manifest(model, tmp_path / "in.parquet", tmp_path / "out")
    with pytest.raises(JobError, match="cannot load the model's weights .*SafetensorError"):
        run_job(manifest, progress=False)
    assert not (tmp_path / "out").exists()
