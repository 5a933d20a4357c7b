"""``cbrun compact`` and ``output.compact``: fewer, bigger parts with the same rows, safe against a kill at any
moment, still resumable; and an empty job's single empty part."""

from __future__ import annotations

import pathlib

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.cli import main
from cbrun.jobs.output.commits import read_records
from cbrun.jobs.output.compact import compact_output
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.output.part_log import groups_by_size
from cbrun.jobs.output.writer import committed_parts
from cbrun.jobs.run.job import run_job
from cbrun.jobs.store import files as storage
from cbrun.jobs.store.store import FsspecStore
from tests.jobs.job_files import write_prompts
from tests.jobs.test_storage_s3 import rows_once, upload_input

ENGINE_CONFIG = EngineConfig(page_size=8, max_batch_tokens=64, max_requests_per_batch=2, num_blocks=64)
MANIFEST_DEFAULTS = {
    "sampling": SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
    "commit_every_rows": 2,
    "id_column": "id",
}
NUM_ROWS = 12


def target_mb(sizes: list[int], parts_per_file: int = 2) -> float:
    """A target size that merges about ``parts_per_file`` of these parts (bytes) into each file."""
    return (parts_per_file + 0.5) * max(sizes) / 2**20


def local_target(out) -> float:
    return target_mb([p.stat().st_size for p in committed_parts(out)])


def write_input(path, num_rows: int = NUM_ROWS):
    return write_prompts(path, num_rows)


def test_groups_by_size_merges_consecutive_runs_and_leaves_single_parts():
    assert groups_by_size([4, 4, 4, 4, 4, 4, 4], 12) == [[0, 1, 2], [3, 4, 5]]
    assert groups_by_size([20, 4, 4, 20], 12) == [[1, 2]]
    assert groups_by_size([], 12) == []


def test_compact_a_local_output(tiny_model_dir, tiny_engine, make_manifest, tmp_path, capsys):
    path = write_input(tmp_path / "in.parquet", NUM_ROWS + 4)
    manifest = make_manifest(tiny_model_dir, path, tmp_path / "out", limit=NUM_ROWS)
    run_job(manifest, progress=False, engine=tiny_engine)
    before = rows_once(tmp_path / "out")
    assert len(committed_parts(tmp_path / "out")) == NUM_ROWS // 2
    assert main(["compact", str(tmp_path / "out"), "--target-file-mb", str(local_target(tmp_path / "out"))]) == 0
    assert "6 parts -> 3" in capsys.readouterr().out
    assert len(committed_parts(tmp_path / "out")) == 3
    assert rows_once(tmp_path / "out") == before
    assert sorted(pq.read_table(tmp_path / "out").column("row_index").to_pylist()) == list(range(NUM_ROWS))
    # still resumable: the finished job is recognised, and a longer input continues it
    assert run_job(manifest, progress=False, engine=tiny_engine).already_finished
    longer = run_job(make_manifest(tiny_model_dir, path, tmp_path / "out"), progress=False, engine=tiny_engine)
    assert longer.num_skipped == NUM_ROWS and longer.num_rows == 4
    assert sorted(rows_once(tmp_path / "out")) == list(range(NUM_ROWS + 4))


def test_a_compaction_killed_before_removing_the_old_parts_loses_and_doubles_nothing(
    tiny_model_dir, tiny_engine, make_manifest, tmp_path, monkeypatch
):
    manifest = make_manifest(tiny_model_dir, write_input(tmp_path / "in.parquet"), tmp_path / "out")
    run_job(manifest, progress=False, engine=tiny_engine)
    before = rows_once(tmp_path / "out")

    def killed(self, *args, **kwargs):
        raise KeyboardInterrupt  # the kill lands after the merged part is committed, before any old part goes

    target = local_target(tmp_path / "out")
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(pathlib.Path, "unlink", killed)
        compact_output(tmp_path / "out", target)
    assert len(read_output(tmp_path / "out")) == NUM_ROWS + 4  # the merged part's 4 rows are there twice
    summary = run_job(manifest, progress=False, engine=tiny_engine)  # the next run's open removes the copies
    assert summary.num_skipped == NUM_ROWS
    assert rows_once(tmp_path / "out") == before


def test_output_compact_at_finish(tiny_model_dir, tiny_engine, make_manifest, tmp_path):
    manifest = make_manifest(tiny_model_dir, write_input(tmp_path / "in.parquet"), tmp_path / "out")
    probe = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "probe")
    run_job(probe, progress=False, engine=tiny_engine)
    manifest.output.compact, manifest.output.target_file_mb = True, local_target(tmp_path / "probe")
    run_job(manifest, progress=False, engine=tiny_engine)
    assert len(committed_parts(tmp_path / "out")) == 3 and (tmp_path / "out" / "_SUCCESS").is_file()
    assert sorted(rows_once(tmp_path / "out")) == list(range(NUM_ROWS))


def test_compact_an_s3_output_killed_between_its_steps(s3, tiny_model_dir, tiny_engine, make_manifest, monkeypatch):
    source = upload_input(
        s3,
        pa.table(
            {"id": [f"r{i}" for i in range(NUM_ROWS)], "prompt": [f"a prompt for row {i}" for i in range(NUM_ROWS)]}
        ),
    )
    out = s3.uri("out")
    manifest = make_manifest(tiny_model_dir, source, out)
    run_job(manifest, progress=False, engine=tiny_engine)
    before = rows_once(out)
    calls = []

    def remove_then_die(store, name):
        calls.append(name)
        if len(calls) == 2:  # one old record gone, the other still there: rows in two records
            raise KeyboardInterrupt
        real_remove(store, name)

    real_remove = FsspecStore.delete
    sizes = [int(storage.object_info(f"{out}/{r.part}")["size"]) for r in read_records(FsspecStore(out))]
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(FsspecStore, "delete", remove_then_die)
        compact_output(out, target_mb(sizes))
    assert run_job(manifest, progress=False, engine=tiny_engine).num_skipped == NUM_ROWS
    assert rows_once(out) == before
    # a whole compaction, then a resume that finds the job done
    result = compact_output(out, target_mb(sizes))
    assert result.num_written and result.num_parts_after < result.num_parts_before
    assert len(read_records(FsspecStore(out))) == result.num_parts_after
    assert rows_once(out) == before
    assert run_job(manifest, progress=False, engine=tiny_engine).already_finished


def test_an_empty_job_writes_one_empty_part_with_every_column(tiny_model_dir, tiny_engine, make_manifest, tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}), path)
    manifest = make_manifest(tiny_model_dir, path, tmp_path / "out")
    manifest.output.keep_columns = ["prompt"]
    summary = run_job(manifest, progress=False, engine=tiny_engine)
    assert summary.exit_code == 0 and (tmp_path / "out" / "_SUCCESS").is_file()
    assert len(committed_parts(tmp_path / "out")) == 1
    frame = pd.read_parquet(tmp_path / "out")
    assert frame.shape[0] == 0 and {"id", "row_index", "completion", "prompt"} <= set(frame.columns)
    assert read_output(tmp_path / "out").column_names[-1] == "prompt"
