"""Sharded runs: the split (disjoint, covering, on row-group boundaries), shards run one after another equal the
single-process run (greedy and seeded sampling), _SUCCESS only after the last shard, status per shard, another N
refused, a killed shard resumed."""

from __future__ import annotations

import os
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.cli import main
from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.output.lock import OutputLock, Shard
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.output.status import output_progress
from cbrun.jobs.output.writer import committed_parts, part_name
from cbrun.jobs.run.job import JobError, run_job
from cbrun.jobs.run.sharding import shard_ranges, unit_starts
from tests.jobs.job_files import sorted_rows
from tests.jobs.test_resume import kill_after_first_commit, run_args

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=256, max_requests_per_batch=8, num_blocks=64)
MANIFEST_DEFAULTS = {
    "sampling": SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
    "id_column": "id",
    "commit_every_rows": 4,
}
NUM_ROWS = 30


@pytest.fixture
def input_path(tmp_path):
    path = tmp_path / "in.parquet"
    table = pa.table(
        {"id": [f"r{i}" for i in range(NUM_ROWS)], "prompt": [f"prompt {i} " * (1 + i % 4) for i in range(NUM_ROWS)]}
    )
    pq.write_table(table, path, row_group_size=5)
    return path


def test_ranges_are_disjoint_cover_every_row_and_fall_on_row_groups():
    starts = list(range(0, 100, 10))
    for count in range(1, 11):
        ranges = shard_ranges(starts, 100, count)
        assert ranges[0][0] == 0 and ranges[-1][1] == 100
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(start < end and start in starts for start, end in ranges)
    assert shard_ranges(starts, 100, 3) == [(0, 30), (30, 70), (70, 100)]  # by each row group's middle row
    # NOTE: fewer row groups than shards: an even split of the rows.
    assert shard_ranges([0, 50], 100, 4) == [(0, 25), (25, 50), (50, 75), (75, 100)]
    # A limit cuts the row groups past it.
    assert shard_ranges(starts, 35, 2) == [(0, 20), (20, 35)]


def test_unit_starts_are_the_row_groups_of_every_file(tmp_path):
    for name, size in (("a.parquet", 7), ("b.parquet", 5)):
        pq.write_table(pa.table({"prompt": ["x"] * size}), tmp_path / name, row_group_size=3)
    reader = PromptReader(tmp_path, prompt_column="prompt")
    assert unit_starts(reader) == [0, 3, 6, 7, 10]


def test_shard_parse():
    assert Shard.parse("2/8") == Shard(2, 8)
    for bad in ("8/8", "-1/2", "1", "a/b", "1/0"):
        with pytest.raises(ValueError, match="INDEX/COUNT"):
            Shard.parse(bad)


@pytest.mark.parametrize(
    "sampling",
    [None, SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20, ignore_eos=True)],
    ids=["greedy", "seeded"],
)
def test_shards_one_after_another_equal_the_single_process_run(
    tiny_model_dir, tiny_engine, make_manifest, input_path, tmp_path, sampling
):
    settings = {} if sampling is None else {"sampling": sampling, "seed": 7}
    run_job(
        make_manifest(tiny_model_dir, input_path, tmp_path / "single", **settings), engine=tiny_engine, progress=False
    )
    out = tmp_path / "sharded"
    for index in range(3):
        assert not (out / "_SUCCESS").exists()
        summary = run_job(
            make_manifest(tiny_model_dir, input_path, out, shard=f"{index}/3", **settings),
            engine=tiny_engine,
            progress=False,
        )
        assert summary.num_rows == 10 and summary.num_skipped == 0
    assert sorted_rows(out) == sorted_rows(tmp_path / "single")
    assert (out / "_SUCCESS").is_file()
    stats = (out / "_cbrun" / "stats.json").read_text()
    assert '"num_rows_in_output": 30' in stats and '"num_shards": 3' in stats
    names = {p.name for p in committed_parts(out)}
    assert part_name(0, Shard(2, 3)) == "part-s0002of0003-000000.parquet" and part_name(0, Shard(2, 3)) in names
    # Each shard wrote its own rows only, on row-group boundaries.
    for part in committed_parts(out):
        index = int(part.name[6:10])
        row_index = pq.read_table(part).column("row_index").to_numpy()
        assert ((row_index >= 10 * index) & (row_index < 10 * index + 10)).all()
    # A shard rerun finds its rows done.
    again = run_job(
        make_manifest(tiny_model_dir, input_path, out, shard="1/3", **settings), engine=tiny_engine, progress=False
    )
    assert again.already_finished and again.num_skipped == 10


def test_success_only_after_every_shard_and_status_per_shard(
    tiny_model_dir, tiny_engine, make_manifest, input_path, tmp_path, capsys
):
    out = tmp_path / "out"
    run_job(make_manifest(tiny_model_dir, input_path, out, shard="2/3"), engine=tiny_engine, progress=False)
    run_job(make_manifest(tiny_model_dir, input_path, out, shard="0/3"), engine=tiny_engine, progress=False)
    assert not (out / "_SUCCESS").exists() and not (out / "_cbrun" / "stats.json").exists()
    progress = output_progress(out)
    assert [(p.name, p.rows, p.num_done, p.complete) for p in progress] == [
        ("shard 0/3", (0, 10), 10, True),
        ("shard 1/3", (10, 20), 0, False),
        ("shard 2/3", (20, 30), 10, True),
        ("total", (0, 30), 20, False),
    ]
    assert main(["status", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "shard 1/3: 0/10 rows done (input rows 10..19), 0 error rows, not complete" in printed
    assert "total: 20/30 rows done, 0 error rows, not complete" in printed
    run_job(make_manifest(tiny_model_dir, input_path, out, shard="1/3"), engine=tiny_engine, progress=False)
    assert (out / "_SUCCESS").is_file()
    assert main(["status", str(out)]) == 0
    assert "total: 30/30 rows done, 0 error rows, complete" in capsys.readouterr().out


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="the host's lock table is Linux's /proc/locks")
def test_status_says_which_shards_a_live_run_holds(
    tiny_model_dir, tiny_engine, make_manifest, input_path, tmp_path, capsys
):
    out = tmp_path / "out"
    run_job(make_manifest(tiny_model_dir, input_path, out, shard="0/3"), engine=tiny_engine, progress=False)
    assert main(["status", str(out)]) == 1
    printed = capsys.readouterr().out
    # Shards that never started need their own flag, not "the same command".
    assert (
        "no cbrun run holds shards 1/3, 2/3 now: run the job with --shard 1/3, --shard 2/3 (one run per shard) "
        "to resume them"
    ) in printed
    assert "running now" not in printed
    with OutputLock(out, Shard(1, 3)):  # a live run of shard 1, as the host's lock table shows it
        assert main(["status", str(out)]) == 1
        printed = capsys.readouterr().out
    assert f"running now: shard 1/3 (host {socket.gethostname()}, pid {os.getpid()}, started " in printed
    assert "no cbrun run holds shard 2/3 now: run the job with --shard 2/3 (one run per shard) to resume it" in printed
    assert "shard 0/3 (host" not in printed
    assert main(["status", str(out)]) == 1  # released: the lock file stays, its lock does not
    assert "no cbrun run holds shards 1/3, 2/3 now" in capsys.readouterr().out


def test_overwrite_of_one_shard_keeps_the_others_and_status_stays_true(
    tiny_model_dir, tiny_engine, make_manifest, input_path, tmp_path, capsys
):
    out = tmp_path / "out"
    for shard in ("0/3", "1/3", "2/3"):
        run_job(make_manifest(tiny_model_dir, input_path, out, shard=shard), engine=tiny_engine, progress=False)
    manifest = make_manifest(tiny_model_dir, input_path, out, shard="1/3")
    manifest.output.overwrite = True
    run_job(manifest, engine=tiny_engine, progress=False)  # recomputes shard 1's rows alone
    assert sorted(read_output(out).column("row_index").to_pylist()) == list(range(30))
    assert main(["status", str(out)]) == 0
    assert "total: 30/30 rows done, 0 error rows, complete" in capsys.readouterr().out
    plain = make_manifest(tiny_model_dir, input_path, tmp_path / "plain")
    plain.output.overwrite = True
    run_job(plain, engine=tiny_engine, progress=False)
    assert main(["status", str(tmp_path / "plain")]) == 0  # --overwrite keeps the shards file it writes


def test_another_shard_count_is_refused_unless_overwrite(
    tiny_model_dir, tiny_engine, make_manifest, input_path, tmp_path
):
    out = tmp_path / "out"
    run_job(make_manifest(tiny_model_dir, input_path, out, shard="0/3"), engine=tiny_engine, progress=False)
    before = sorted(p.name for p in out.iterdir())
    for other in ("0/2", "1/4", None):
        with pytest.raises(
            JobError,
            match=r"split into 3 shard\(s\), but this run splits it into "
            rf"{other[-1] if other else 1} .*same N.*--overwrite",
        ):
            run_job(make_manifest(tiny_model_dir, input_path, out, shard=other), engine=tiny_engine, progress=False)
    assert sorted(p.name for p in out.iterdir()) == before
    manifest = make_manifest(tiny_model_dir, input_path, out, shard="1/2")
    manifest.output.overwrite = True
    run_job(manifest, engine=tiny_engine, progress=False)
    assert sorted(read_output(out).column("row_index").to_pylist()) == list(range(15, 30))
    assert all(p.name.startswith("part-s0001of0002-") for p in committed_parts(out))
    assert sorted(p.name for p in (out / "_cbrun").glob("stats-*")) == ["stats-1-of-2.json"]


@pytest.mark.slow
def test_killed_shard_resumes_and_the_shards_equal_the_single_process_run(tiny_model_dir, input_path, tmp_path, capsys):
    out = tmp_path / "out"
    args = run_args(tiny_model_dir, input_path, out)
    kill_after_first_commit(args + ["--shard", "1/2"], out)
    killed = read_output(out).column("row_index").to_pylist()
    assert 0 < len(killed) < 15 and all(15 <= i < 30 for i in killed)
    for shard, skipped in (("1/2", len(killed)), ("0/2", 0)):
        assert main(args + ["--shard", shard]) == 0
        assert f"(0 errors, {skipped} skipped)" in capsys.readouterr().out
    assert (out / "_SUCCESS").is_file()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    single = tmp_path / "single"
    assert main(run_args(tiny_model_dir, input_path, single)) == 0
    got, expected = sorted_rows(out), sorted_rows(single)
    assert [r["row_index"] for r in got] == list(range(NUM_ROWS))
    assert [(r["id"], r["completion_token_ids"]) for r in got] == [
        (r["id"], r["completion_token_ids"]) for r in expected
    ]


def test_a_shard_reads_only_its_row_groups(
    tiny_model_dir, tiny_engine, make_manifest, input_path, tmp_path, monkeypatch
):
    read = []
    original = pq.ParquetFile.iter_batches

    def recording(self, *args, row_groups=None, **kwargs):
        read.extend(row_groups or [])  # NOTE: None: an output part read back by the checkpoint
        return original(self, *args, row_groups=row_groups, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", recording)
    # NOTE: without an id column: the repeated-id check (jobs.output.row_ids) scans the id column of the whole input.
    run_job(
        make_manifest(tiny_model_dir, input_path, tmp_path / "out", shard="1/3", id_column=None),
        engine=tiny_engine,
        progress=False,
    )
    assert read == [2, 3]  # rows 10..19, in row groups of 5
    assert sorted(read_output(tmp_path / "out").column("row_index").to_pylist()) == list(range(10, 20))
