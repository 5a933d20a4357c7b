"""n samples per row: one output row per sample with its sample_index, per-row n, seeds that differ across samples
but are reproducible, samples sharing their prompt blocks, and exact resume when a run stops mid-row."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.manifest import load_manifest
from cbrun.jobs.modes.generate import derive_seed, sample_seeds
from cbrun.jobs.output.fingerprint import job_fingerprint
from cbrun.jobs.output.writer import committed_parts
from cbrun.jobs.run.job import JobError, run_job
from tests.jobs.job_files import write_prompts

ENGINE_CONFIG = EngineConfig(page_size=4, max_batch_tokens=64, max_requests_per_batch=4, num_blocks=128)
MANIFEST_DEFAULTS = {
    "sampling": SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True),
    "seed": 3,
    "commit_every_rows": 1,
    "id_column": "id",
}


def write_input(path, num_rows: int, **extra):
    return write_prompts(path, num_rows, "a shared opening line, then row {i}", **extra)


def samples(output_dir) -> dict[int, list[dict]]:
    """{row_index: its output rows in sample order}, checking no (row_index, sample_index) appears twice."""
    rows = [r for p in committed_parts(output_dir) for r in pq.read_table(p).to_pylist()]
    keys = [(r["row_index"], r["sample_index"]) for r in rows]
    assert len(set(keys)) == len(keys), "a sample was written twice"
    by_row: dict[int, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (r["row_index"], r["sample_index"])):
        by_row.setdefault(r["row_index"], []).append(r)
    return by_row


def test_seeds_derive_from_job_seed_row_id_and_sample_index():
    assert derive_seed(5, "a", 0) == derive_seed(5, "a")  # sample 0 keeps the one-sample seed
    seeds = sample_seeds(5, "a", 4)
    assert len(set(seeds)) == 4 and seeds == sample_seeds(5, "a", 4)
    assert seeds[:2] == sample_seeds(5, "a", 2)  # a sample's seed does not depend on n
    assert set(seeds).isdisjoint(sample_seeds(6, "a", 4)) and set(seeds).isdisjoint(sample_seeds(5, "b", 4))
    with_column = sample_seeds(5, "a", 3, row_seed=42)
    assert with_column[0] == 42 and len(set(with_column)) == 3


def test_n_samples_are_separate_rows_that_differ_and_reproduce(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    write_input(tmp_path / "in.parquet", 4)
    runs = []
    for name in ("a", "b"):
        summary = run_job(
            make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / name, n=3),
            progress=False,
            engine=tiny_engine,
        )
        assert (summary.num_rows, summary.num_output_rows, summary.num_errors) == (4, 12, 0)
        assert "| 12 samples |" in summary.line()
        runs.append(samples(tmp_path / name))
    assert runs[0] == runs[1]  # same job seed: the same samples, whatever the batching
    for row_index, rows in runs[0].items():
        assert [r["sample_index"] for r in rows] == [0, 1, 2]
        assert {r["id"] for r in rows} == {f"r{row_index}"}
        assert len({tuple(r["completion_token_ids"]) for r in rows}) == 3  # seeds differ across samples
    one = run_job(
        make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "one"), progress=False, engine=tiny_engine
    )
    assert "samples" not in one.line()
    single = samples(tmp_path / "one")
    assert {i: rows[0] for i, rows in runs[0].items()} == {i: rows[0] for i, rows in single.items()}
    assert pq.read_schema(committed_parts(tmp_path / "one")[0]).field("sample_index").type == pa.int32()


def test_per_row_n_column_and_bad_values(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    n_column = pa.array([1, 4, None, 2, 0, 1.5], pa.float64())
    write_input(tmp_path / "in.parquet", 6, n=n_column)
    summary = run_job(
        make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", n=2),
        progress=False,
        engine=tiny_engine,
    )
    out = samples(tmp_path / "out")
    assert {i: len(rows) for i, rows in out.items()} == {0: 1, 1: 4, 2: 2, 3: 2, 4: 1, 5: 1}
    assert (summary.num_rows, summary.num_output_rows, summary.num_errors) == (6, 11, 2)
    for i in (4, 5):  # a row that cannot run writes one error row, sample 0
        (row,) = out[i]
        assert row["finish_reason"] == "error" and row["sample_index"] == 0
        assert row["error"].startswith(f"row {i} (id 'r{i}'): n (samples per row) must be an integer >= 1")


def test_seed_column_seeds_sample_zero_and_the_others_differ(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    write_input(tmp_path / "in.parquet", 2, seed=pa.array([11, 11], pa.int64()))
    run_job(
        make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", n=2),
        progress=False,
        engine=tiny_engine,
    )
    out = samples(tmp_path / "out")
    pq.write_table(
        pa.table({"id": ["x"], "prompt": ["a shared opening line, then row 0"], "seed": pa.array([11], pa.int64())}),
        tmp_path / "one.parquet",
    )
    run_job(
        make_manifest(tiny_model_dir, tmp_path / "one.parquet", tmp_path / "one"), progress=False, engine=tiny_engine
    )
    assert out[0][0]["completion_token_ids"] == samples(tmp_path / "one")[0][0]["completion_token_ids"]
    assert out[0][0]["completion_token_ids"] != out[0][1]["completion_token_ids"]


def test_samples_of_a_row_share_its_prompt_blocks(tiny_model_dir, tmp_path, make_manifest):
    from cbrun.engine import LLMEngine

    engine = LLMEngine.from_pretrained(str(tiny_model_dir), ENGINE_CONFIG)  # a fresh, empty prefix cache
    pq.write_table(pa.table({"id": ["a"], "prompt": ["x" * 40]}), tmp_path / "in.parquet")
    run_job(
        make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", n=4), progress=False, engine=engine
    )
    # 41 prompt tokens (BOS + 40): samples 1..3 each take the 10 full blocks below the last token from the cache.
    assert engine.stats.num_prompt_tokens == 4 * 41
    assert engine.stats.num_cached_prompt_tokens == 3 * 40


def test_interrupted_run_commits_whole_rows_and_resumes_exactly(
    tiny_model_dir, tiny_engine, tmp_path, monkeypatch, make_manifest
):
    write_input(tmp_path / "in.parquet", 8, n=pa.array([3, 1, 2, 3, None, 2, 3, 1], pa.int64()))
    run_job(
        make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "reference", n=2),
        progress=False,
        engine=tiny_engine,
    )
    expected = samples(tmp_path / "reference")

    from cbrun.engine import LLMEngine

    # NOTE: its own engine: an interrupted generate leaves its requests in the engine, as in a killed process.
    engine = LLMEngine.from_pretrained(str(tiny_model_dir), ENGINE_CONFIG)
    generate = engine.generate

    def interrupted_generate(requests, **kwargs):
        for k, output in enumerate(generate(requests, **kwargs)):
            if k == 7:  # mid-run, with rows whose other samples are still running
                raise KeyboardInterrupt
            yield output

    monkeypatch.setattr(engine, "generate", interrupted_generate)
    manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", n=2)
    with pytest.raises(KeyboardInterrupt):
        run_job(manifest, progress=False, engine=engine)
    partial = samples(tmp_path / "out")
    assert 0 < len(partial) < 8
    assert all(partial[i] == expected[i] for i in partial)  # only whole rows were committed

    summary = run_job(manifest, progress=False, engine=tiny_engine)
    assert summary.num_skipped == len(partial) and summary.num_rows == 8 - len(partial)
    assert samples(tmp_path / "out") == expected


def test_n_setting_is_validated_and_part_of_the_fingerprint(tmp_path):
    sets = [f"{s}.path=x" for s in ("model", "input", "output")] + ["input.prompt_column=p"]
    assert load_manifest(None, [*sets, "sampling.n=4"]).n == 4
    assert load_manifest(None, sets).n == 1
    for bad in ("0", "1.5", "true"):
        with pytest.raises(ValueError, match="sampling.n"):
            load_manifest(None, [*sets, f"sampling.n={bad}"])
    manifest = load_manifest(None, sets)
    base = job_fingerprint(manifest, 10)
    manifest.n = 2
    assert job_fingerprint(manifest, 10)["sampling"]["n"] == 2 != base["sampling"]["n"]
    manifest.input.order_window = 0  # order only: not part of the fingerprint
    assert job_fingerprint(manifest, 10)["input"] == base["input"]
    with pytest.raises(ValueError, match="input.order_window"):
        load_manifest(None, [*sets, "input.order_window=-1"])


def test_changing_n_refuses_to_resume(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    write_input(tmp_path / "in.parquet", 2)
    run_job(
        make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", n=2),
        progress=False,
        engine=tiny_engine,
    )
    with pytest.raises(JobError, match="sampling.n"):
        run_job(
            make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", n=3),
            progress=False,
            engine=tiny_engine,
        )
