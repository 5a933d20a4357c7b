"""Checkpoint: fingerprint match/mismatch/overwrite, done-row bitmap from parts, stray temp cleanup."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from jobs.checkpoint import Checkpoint, FingerprintMismatch, fingerprint_differences, job_fingerprint
from jobs.manifest import InputSettings, JobManifest, ModelSettings, OutputSettings
from jobs.writer import OutputRow, PartWriter


@pytest.fixture
def manifest(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 10}')
    (model / "tokenizer.json").write_text("{}")
    return JobManifest(
        model=ModelSettings(path=str(model)),
        input=InputSettings(path=str(tmp_path / "in.parquet"), prompt_column="q", limit=5),
        sampling=SamplingParams(max_new_tokens=8),
        engine=EngineConfig(page_size=16, max_batch_tokens=256),
        output=OutputSettings(path=str(tmp_path / "out")),
    )


def rows(*indices):
    return [OutputRow(id=str(i), row_index=i, completion="x", completion_token_ids=[1], num_prompt_tokens=1,
                      num_completion_tokens=1, finish_reason="stop") for i in indices]


def test_fingerprint_ignores_speed_settings_and_limit(manifest):
    base = job_fingerprint(manifest, 100)
    manifest.engine = EngineConfig(page_size=32, max_batch_tokens=1024, max_requests_per_batch=8)
    manifest.input.limit = 50
    assert job_fingerprint(manifest, 100) == base
    assert base["input"]["path"].endswith("in.parquet") and base["sampling"]["job_seed"] == 0


def test_fingerprint_changes_with_outputs_settings(manifest):
    base = job_fingerprint(manifest, 100)
    manifest.sampling = manifest.sampling.replace(max_new_tokens=9)
    assert fingerprint_differences(base, job_fingerprint(manifest, 100)) == ["sampling.max_new_tokens"]
    manifest.seed = 3
    Path(manifest.model.path, "tokenizer.json").write_text('{"a": 1}')
    assert fingerprint_differences(base, job_fingerprint(manifest, 101)) == [
        "input.num_rows", "model.files_sha256", "sampling.job_seed", "sampling.max_new_tokens"]


def test_prepare_match_mismatch_and_overwrite(manifest, tmp_path):
    out = tmp_path / "out"
    checkpoint = Checkpoint(out)
    fingerprint = job_fingerprint(manifest, 100)
    checkpoint.prepare(fingerprint)
    assert json.loads((out / "job.json").read_text()) == fingerprint
    writer = PartWriter(out)
    for row in rows(0, 1):
        writer.add(row)
    writer.commit()
    checkpoint.prepare(fingerprint)  # same job: resumes, keeps parts
    assert checkpoint.done_rows(3).tolist() == [True, True, False]

    other = job_fingerprint(manifest, 100)
    other["sampling"]["temperature"] = 0.7
    with pytest.raises(FingerprintMismatch, match=r"different job \(changed: sampling.temperature\).*--overwrite"):
        checkpoint.prepare(other)
    (out / "user-notes.txt").write_text("keep me")
    checkpoint.mark_finished(fingerprint, {"num_rows": 2})
    checkpoint.prepare(other, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["job.json", "user-notes.txt"]
    assert json.loads((out / "job.json").read_text()) == other


def test_done_rows_bitmap_from_committed_parts(tmp_path):
    writer = PartWriter(tmp_path, commit_every_rows=2)
    for row in rows(5, 1, 7, 2, 9):
        writer.add(row)
    writer.commit()
    done = Checkpoint(tmp_path).done_rows(9)  # row 9 lies past a smaller limit: ignored
    assert done.dtype == np.bool_ and np.flatnonzero(done).tolist() == [1, 2, 5, 7]


def test_stray_temp_files_are_removed(tmp_path):
    (tmp_path / ".part-000004.parquet.tmp").write_bytes(b"half")
    (tmp_path / ".job.json.tmp").write_text("{")
    (tmp_path / "part-000000.parquet").write_bytes(b"")
    removed = Checkpoint(tmp_path).remove_temp_files()
    assert sorted(p.name for p in removed) == [".job.json.tmp", ".part-000004.parquet.tmp"]
    assert [p.name for p in tmp_path.iterdir()] == ["part-000000.parquet"]


def test_finished_marker_and_stats(tmp_path):
    checkpoint = Checkpoint(tmp_path)
    assert not checkpoint.is_finished() and checkpoint.read_stats() is None
    checkpoint.mark_finished({}, {"num_rows": 3})
    assert checkpoint.is_finished() and checkpoint.read_stats() == {"num_rows": 3}
    checkpoint.clear_finished()
    assert not checkpoint.is_finished() and not (tmp_path / "stats.json").exists()


def test_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        Checkpoint(tmp_path / "f").check({})
