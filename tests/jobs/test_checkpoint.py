"""Checkpoint: fingerprint match/mismatch/overwrite, done rows from parts, duplicates, stray temps, the _cbrun/
layout (and older outputs' top-level job.json), the finished marker; the fingerprint sees content."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import SAMPLER_VERSION, SPECULATION_RULE_VERSION, EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from cbrun.jobs.output.fingerprint import SAMPLE_BYTES, fingerprint_differences, job_fingerprint
from cbrun.jobs.output.output_dir import FingerprintMismatch, OutputDir, open_output
from cbrun.jobs.output.writer import (
    OutputRow,
    PartWriter,
    committed_parts,
    error_row,
    rows_to_table,
    write_part_atomically,
)


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
    return [
        OutputRow(
            id=str(i),
            row_index=i,
            completion="x",
            completion_token_ids=[1],
            num_prompt_tokens=1,
            num_completion_tokens=1,
            finish_reason="stop",
        )
        for i in indices
    ]


def locked(path) -> OutputDir:
    checkpoint = open_output(path)
    checkpoint.lock.acquire()
    return checkpoint


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
        "input.num_rows",
        "model.files.tokenizer.json",
        "sampling.job_seed",
        "sampling.max_new_tokens",
    ]


def test_a_greedy_job_resumed_at_a_temperature_names_the_temperature_only(manifest):
    """The sampler's version is recorded once a row may sample: derived from the temperature, never named beside it."""
    greedy = job_fingerprint(manifest, 100, may_sample=False)
    manifest.sampling = manifest.sampling.replace(temperature=0.7)
    sampled = job_fingerprint(manifest, 100, may_sample=True)
    assert "sampler" in sampled["sampling"] and "sampler" not in greedy["sampling"]
    assert fingerprint_differences(greedy, sampled) == ["sampling.temperature"]
    # alone (a per-row temperature column appeared), the derived key is what differs, and it is named
    manifest.sampling = manifest.sampling.replace(temperature=0.0)
    assert fingerprint_differences(greedy, job_fingerprint(manifest, 100, may_sample=True)) == ["sampling.sampler"]


def test_a_sampled_job_records_its_tensor_parallel_size_above_one(manifest):
    """A sampled row's logits differ in their last bits between rank counts: a resume at another count must not mix
    them; a greedy job, whose tokens do not depend on it, and tp = 1 keep their fingerprints."""
    sampled_tp1 = job_fingerprint(manifest, 100, may_sample=True)
    greedy_tp1 = job_fingerprint(manifest, 100, may_sample=False)
    manifest.engine = EngineConfig(tensor_parallel_size=2)
    assert fingerprint_differences(sampled_tp1, job_fingerprint(manifest, 100, may_sample=True)) == [
        "sampling.tensor_parallel_size"
    ]
    assert job_fingerprint(manifest, 100, may_sample=False) == greedy_tp1
    assert "tensor_parallel_size" not in sampled_tp1["sampling"]


def test_an_fp8_kv_cache_is_recorded_for_greedy_jobs_too(manifest):
    """A lossy KV cache changes greedy tokens: a resume with another kv_cache_dtype must not mix them; "auto" keeps
    the fingerprints of earlier jobs."""
    before = job_fingerprint(manifest, 100, may_sample=False)
    assert "kv_cache_dtype" not in before["model"]
    manifest.engine = EngineConfig(kv_cache_dtype="fp8_e4m3")
    after = job_fingerprint(manifest, 100, may_sample=False)
    assert fingerprint_differences(before, after) == ["model.kv_cache_dtype"]


def test_w8a8_linears_are_recorded_for_greedy_jobs_too(manifest):
    """W8A8 (fp8_activation_scheme "dynamic") changes greedy tokens: a resume with the other scheme must not mix
    them; "none" keeps the fingerprints of earlier jobs."""
    before = job_fingerprint(manifest, 100, may_sample=False)
    assert "fp8_activation_scheme" not in before["model"]
    manifest.engine = EngineConfig(fp8_activation_scheme="dynamic")
    after = job_fingerprint(manifest, 100, may_sample=False)
    assert fingerprint_differences(before, after) == ["model.fp8_activation_scheme"]


def test_fingerprint_records_speculation_only_when_on(manifest):
    """n-gram settings change sampled rows' draws, so a resume must not mix them; "off" keeps older fingerprints."""
    off = job_fingerprint(manifest, 100)
    assert "speculative" not in off
    manifest.engine = EngineConfig(page_size=16, max_batch_tokens=256, speculative="ngram")
    ngram = job_fingerprint(manifest, 100)
    assert fingerprint_differences(off, ngram) == ["speculative"]
    assert ngram["speculative"]["mode"] == "ngram" and ngram["speculative"]["num_speculative_tokens"] == 8
    assert (
        ngram["speculative"]["rule"] == SPECULATION_RULE_VERSION
    )  # a new proposal rule changes sampled rows' draws too
    manifest.engine = EngineConfig(page_size=16, max_batch_tokens=256, speculative="ngram", num_speculative_tokens=2)
    assert fingerprint_differences(ngram, job_fingerprint(manifest, 100)) == ["speculative.num_speculative_tokens"]


def test_fingerprint_sees_weights_chat_template_and_input_content(manifest, tmp_path):
    """Same sizes, same row count, same names: the content changed, and the refusal names the file."""
    model = Path(manifest.model.path)
    weights = model / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**18], "data_offsets": [0, 2**20]}}).encode()
    body = bytearray(np.arange(2**18, dtype=np.float32).tobytes())
    weights.write_bytes(len(header).to_bytes(8, "little") + header + bytes(body))
    pq.write_table(pa.table({"q": ["what is 2 + 2?", "name a colour"]}), manifest.input.path)
    base = job_fingerprint(manifest, 2)

    body[-1] ^= 1  # the last byte is in the last sampled range
    weights.write_bytes(len(header).to_bytes(8, "little") + header + bytes(body))
    assert fingerprint_differences(base, job_fingerprint(manifest, 2)) == ["model.weights.model.safetensors"]
    body[-1] ^= 1
    weights.write_bytes(len(header).to_bytes(8, "little") + header + bytes(body))
    assert job_fingerprint(manifest, 2) == base  # content, not modification time

    (model / "chat_template.jinja").write_text("{{ messages }}")
    assert fingerprint_differences(base, job_fingerprint(manifest, 2)) == ["model.files.chat_template.jinja"]
    (model / "chat_template.jinja").unlink()

    pq.write_table(pa.table({"q": ["what is 3 + 3?", "name a colour"]}), manifest.input.path)  # same row count
    assert fingerprint_differences(base, job_fingerprint(manifest, 2)) == ["input.files.in.parquet"]


def test_big_files_are_sampled_not_read(tmp_path):
    from cbrun.jobs.output.fingerprint import NUM_SAMPLES, sampled_digest

    path = tmp_path / "big.bin"
    data = bytearray(20 * SAMPLE_BYTES)
    path.write_bytes(bytes(data))
    base = sampled_digest(path)
    data[3 * SAMPLE_BYTES] = 1  # between the head and the first sampled range: documented as missed
    path.write_bytes(bytes(data))
    assert sampled_digest(path) == base and NUM_SAMPLES == 4
    data[-1] = 1
    path.write_bytes(bytes(data))
    assert sampled_digest(path) != base


def test_older_fingerprints_compare_on_what_both_recorded(manifest):
    new = job_fingerprint(manifest, 100)
    old = json.loads(json.dumps(new))
    del old["model"]["weights"], old["input"]["files"]
    assert fingerprint_differences(old, new) == []
    old["model"]["files_sha256"] = "written by an earlier version"
    assert fingerprint_differences(old, new) == []
    old["input"]["num_rows"] = 99
    del old["sampling"]["n"]
    assert fingerprint_differences(old, new) == ["input.num_rows", "sampling.n"]  # any other key is a difference


def test_prepare_match_mismatch_and_overwrite(manifest, tmp_path):
    out = tmp_path / "out"
    checkpoint = open_output(out)
    fingerprint = job_fingerprint(manifest, 100)
    checkpoint.prepare(fingerprint)
    assert json.loads((out / "_cbrun" / "job.json").read_text()) == fingerprint
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
    assert sorted(p.name for p in out.iterdir()) == ["_cbrun", "user-notes.txt"]
    assert json.loads((out / "_cbrun" / "job.json").read_text()) == other


def test_older_layout_is_read_and_moved_into_cbrun_dir(manifest, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    fingerprint = job_fingerprint(manifest, 100)
    (out / "job.json").write_text(json.dumps(fingerprint))
    (out / "stats.json").write_text('{"num_rows": 1}')
    writer = PartWriter(out)
    writer.add(rows(0)[0])
    writer.commit()
    checkpoint = locked(out)
    assert checkpoint.read_stats() == {"num_rows": 1}
    other = dict(fingerprint, cbrun_version="other")
    with pytest.raises(FingerprintMismatch, match="cbrun_version"):
        checkpoint.open(other, 3)
    assert checkpoint.open(fingerprint, 3).done.tolist() == [True, False, False]
    checkpoint.start(fingerprint, 10, 10.0)
    assert sorted(p.name for p in out.iterdir()) == ["_cbrun", "part-000000.parquet"]
    assert json.loads((out / "_cbrun" / "job.json").read_text()) == fingerprint


def test_done_rows_bitmap_from_committed_parts(tmp_path):
    writer = PartWriter(tmp_path, commit_every_rows=2)
    for row in rows(5, 1, 7, 2, 9):
        writer.add(row)
    writer.commit()
    done = open_output(tmp_path).done_rows(9)  # row 9 lies past a smaller limit: ignored
    assert done.dtype == np.bool_ and np.flatnonzero(done).tolist() == [1, 2, 5, 7]


def test_duplicates_are_reported_and_the_earliest_copy_kept(manifest, tmp_path, caplog):
    out = tmp_path / "out"
    checkpoint = locked(out)
    fingerprint = job_fingerprint(manifest, 100)
    checkpoint.prepare(fingerprint)
    # parts as two unlocked runs (or an older cbrun's interrupted commit) left them: rows 1, 2 twice, 3 three times
    two_samples = [
        OutputRow(
            id="3",
            row_index=3,
            completion=f"s{k}",
            completion_token_ids=[1],
            num_prompt_tokens=1,
            num_completion_tokens=1,
            finish_reason="stop",
            sample_index=k,
        )
        for k in range(2)
    ]
    for i, part in enumerate([rows(0, 1, 2), rows(1, 2) + two_samples, two_samples, rows(4)]):
        write_part_atomically(out / f"part-{i:06d}.parquet", rows_to_table(part))
    with caplog.at_level("WARNING", logger="cbrun"):
        state = checkpoint.open(fingerprint, 5)
    assert "3 rows written more than once" in caplog.text and "part-000001.parquet, part-000002.parquet" in caplog.text
    assert state.done.all() and state.num_duplicates == 4 and state.num_output_rows == 6
    table = pa.concat_tables(pq.read_table(p) for p in committed_parts(out))
    keys = sorted(zip(table.column("row_index").to_pylist(), table.column("sample_index").to_pylist()))
    assert keys == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (4, 0)]
    assert [p.name for p in committed_parts(out)] == [
        "part-000000.parquet",
        "part-000001.parquet",
        "part-000003.parquet",
    ]  # part 2 held only copies
    assert checkpoint.remove_duplicates() == 0  # idempotent


def test_error_rows_are_counted_and_retry_takes_them_out(manifest, tmp_path):
    out = tmp_path / "out"
    checkpoint = locked(out)
    fingerprint = job_fingerprint(manifest, 100)
    writer = checkpoint.start(fingerprint, 100, 100.0)
    writer.add_group(rows(0, 1) + [error_row("2", 2, "row 2: bad")])
    writer.commit()
    checkpoint.mark_finished(fingerprint, {})
    state = checkpoint.open(fingerprint, 4)
    assert (state.error_rows.tolist(), state.num_output_rows, state.num_error_rows) == ([2], 3, 1)
    state = checkpoint.open(fingerprint, 4, retry_errors=True)
    assert state.done.tolist() == [True, True, False, False] and state.num_error_rows == 0
    assert not checkpoint.is_finished()


def test_stray_temp_files_are_removed(tmp_path):
    (tmp_path / ".part-000004.parquet.tmp").write_bytes(b"half")
    (tmp_path / ".job.json.tmp").write_text("{")
    (tmp_path / "_cbrun").mkdir()
    (tmp_path / "_cbrun" / ".stats.json.tmp").write_text("{")
    (tmp_path / "part-000000.parquet").write_bytes(b"")
    removed = open_output(tmp_path).parts.remove_temp_files()
    assert sorted(p.name for p in removed) == [".job.json.tmp", ".part-000004.parquet.tmp", ".stats.json.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_cbrun", "part-000000.parquet"]


def test_finished_marker_and_stats(tmp_path):
    checkpoint = open_output(tmp_path)
    assert not checkpoint.is_finished() and checkpoint.read_stats() is None
    checkpoint.mark_finished({}, {"num_rows": 3})
    assert checkpoint.is_finished() and checkpoint.read_stats() == {"num_rows": 3}
    assert (tmp_path / "_cbrun" / "stats.json").is_file()
    checkpoint.clear_finished()
    assert not checkpoint.is_finished() and not (tmp_path / "_cbrun" / "stats.json").exists()


def test_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        open_output(tmp_path / "f").check({})


def test_fingerprint_records_the_sampler_version(manifest):
    """A new random stream changes every seeded sampled row: a job written by the old sampler is not resumed."""
    current = job_fingerprint(manifest, 100)
    assert current["sampling"]["sampler"] == SAMPLER_VERSION
    older = json.loads(json.dumps(current))
    del older["sampling"]["sampler"]
    assert fingerprint_differences(older, current) == ["sampling.sampler"]
    # version 2 drew the CPU's rows in PyTorch, 3 with the C kernel: the same rule, not always the same floats
    older["sampling"]["sampler"] = SAMPLER_VERSION - 1
    assert fingerprint_differences(older, current) == ["sampling.sampler"]


def test_a_greedy_job_of_an_earlier_version_still_resumes(manifest):
    """The random stream never decides a greedy row's tokens: a job with no sampled row records no sampler
    version, so its fingerprint equals the one an earlier version wrote."""
    greedy = job_fingerprint(manifest, 100, may_sample=False)
    assert "sampler" not in greedy["sampling"]
    sampled = job_fingerprint(manifest, 100, may_sample=True)
    assert fingerprint_differences(greedy, sampled) == ["sampling.sampler"]
