"""The Ray Data executor on a local Ray instance (2 CPUs): 2 replicas equal the single-process run (greedy rows and
seeded sampled rows), a SIGKILLed driver resumes with every row once, spans of pending rows, the extra named when
Ray is missing. Skipped when Ray Data is not installed (the extra cbrun[ray])."""

from __future__ import annotations

import logging
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.cli import main
from cbrun.jobs.cli.parser import build_parser
from cbrun.jobs.config.manifest import load_manifest
from cbrun.jobs.config.settings import ClusterSettings
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import run_job
from cbrun.jobs.run.ray_executor import QUIET_RAY_ENV, RAY_EXTRA_MESSAGE, pending_spans, quiet_ray_logs
from tests.jobs.cli_args import run_argv
from tests.jobs.job_files import sorted_rows
from tests.jobs.test_resume import kill_after_first_commit, run_args

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=256, max_requests_per_batch=8, num_blocks=64, device="cpu")
MANIFEST_DEFAULTS = {
    "sampling": SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
    "id_column": "id",
    "commit_every_rows": 32,
}
NUM_ROWS = 200


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_pending_spans_cover_the_rows_not_done_in_batches():
    done = np.zeros(12, dtype=bool)
    done[[0, 1, 5, 11]] = True
    assert pending_spans(done, 3) == [(2, 5), (6, 9), (9, 11)]
    assert pending_spans(np.ones(4, dtype=bool), 3) == []


def test_cluster_settings_from_flags_and_sets():
    manifest = load_manifest(
        None,
        [
            "cluster.num_replicas=2",
            "cluster.num_gpus_per_replica=1",
            "cluster.max_concurrent_batches=3",
            "cluster.num_cpus_per_replica=4",
            "cluster.batch_size=64",
        ],
        {
            "model": {"path": "m"},
            "input": {"path": "i", "prompt_column": "p"},
            "output": {"path": "o"},
            "cluster": {"executor": "ray", "address": "auto"},
        },
    )
    assert manifest.cluster == ClusterSettings(
        executor="ray",
        num_replicas=2,
        num_gpus_per_replica=1,
        num_cpus_per_replica=4,
        batch_size=64,
        max_concurrent_batches=3,
        address="auto",
    )
    args = build_parser().parse_args(["run", "--executor", "ray", "--ray-address", "auto", "--shard", "1/4"])
    assert (args.executor, args.ray_address, args.shard) == ("ray", "auto", "1/4")
    for bad, message in (
        ('cluster.executor="spark"', "cluster.executor"),
        ("cluster.num_replicas=0", "num_replicas"),
        ("cluster.batch_size=1.5", "batch_size"),
        ("cluster.num_gpus_per_replica=-1", "num_gpus"),
        ("cluster.max_concurrent_batches=0", "max_concurrent_batches"),
    ):
        with pytest.raises(ValueError, match=message):
            load_manifest(
                None,
                [bad],
                {"model": {"path": "m"}, "input": {"path": "i", "prompt_column": "p"}, "output": {"path": "o"}},
            )


def test_missing_ray_exits_2_naming_the_extra(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "in.parquet")
    args = [
        *run_argv(str(tiny_model_dir), str(tmp_path / "in.parquet"), str(tmp_path / "out")),
        "--prompt-column",
        "prompt",
        "--executor",
        "ray",
        "--no-progress",
    ]
    assert main(args) == 2
    assert "pip install 'cbrun[ray]'" in capsys.readouterr().err and RAY_EXTRA_MESSAGE.endswith("ray[data])")
    assert not (tmp_path / "out").exists()


@pytest.mark.ray
def test_two_replicas_equal_the_single_process_run(local_ray, stories260k_dir, make_manifest, tmp_path):
    path = tmp_path / "in.parquet"
    # Every third row is sampled (its temperature column) with a seed derived from the row id alone.
    temperature = [0.8 if i % 3 == 0 else None for i in range(NUM_ROWS)]
    pq.write_table(
        pa.table(
            {
                "id": [f"s{i}" for i in range(NUM_ROWS)],
                "prompt": [f"Once upon a time, {'Lily' if i % 2 else 'Tom'} saw {i}" for i in range(NUM_ROWS)],
                "temperature": pa.array(temperature, pa.float64()),
            }
        ),
        path,
        row_group_size=50,
    )
    single = make_manifest(stories260k_dir, path, tmp_path / "single")
    single.seed = 5
    run_job(single, progress=False)
    on_ray = make_manifest(stories260k_dir, path, tmp_path / "ray")
    on_ray.seed = 5
    on_ray.cluster = ClusterSettings(executor="ray", num_replicas=2, num_cpus_per_replica=1, batch_size=40)
    summary = run_job(on_ray, progress=False)
    assert summary.num_rows == NUM_ROWS and summary.num_errors == 0
    assert (tmp_path / "ray" / "_SUCCESS").is_file()
    got, expected = sorted_rows(tmp_path / "ray"), sorted_rows(tmp_path / "single")
    assert len(got) == NUM_ROWS and any(r["completion_token_ids"] for r in got)
    assert got == expected


@pytest.mark.ray
def test_a_replica_runs_the_rows_of_two_batches_in_one_step(local_ray, stories260k_dir, make_manifest, tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(
        pa.table({"id": [f"b{i}" for i in range(20)], "prompt": [f"Tom had {i} cats" for i in range(20)]}), path
    )
    single = make_manifest(stories260k_dir, path, tmp_path / "single")
    run_job(single, progress=False)
    on_ray = make_manifest(stories260k_dir, path, tmp_path / "ray")
    # Batches of 5 rows, 2 at once (the default max_concurrent_batches) into 8 engine slots: the second batch's
    # rows join the first's steps.
    on_ray.cluster = ClusterSettings(executor="ray", num_replicas=1, batch_size=5)
    summary = run_job(on_ray, progress=False)
    assert summary.replica_stats["num_row_steps_shared_across_batches"] > 0
    assert sorted_rows(tmp_path / "ray") == sorted_rows(tmp_path / "single")


@pytest.mark.ray
@pytest.mark.slow
def test_killed_driver_resumes_every_row_once(local_ray, tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "in.parquet"
    pq.write_table(
        pa.table({"id": [f"r{i}" for i in range(60)], "prompt": [f"row {i} says" for i in range(60)]}),
        path,
        row_group_size=10,
    )
    out = tmp_path / "out"
    args = run_args(tiny_model_dir, path, out) + [
        "--executor",
        "ray",
        "--set",
        "cluster.batch_size=4",
        "--set",
        "cluster.num_replicas=1",
    ]
    kill_after_first_commit(args, out, timeout_s=240)  # the Ray instance the driver started dies with it
    killed = read_output(out).column("row_index").to_pylist()
    assert 0 < len(killed) < 60

    assert main(args) == 0
    assert f"(0 errors, {len(killed)} skipped)" in capsys.readouterr().out
    assert (out / "_SUCCESS").is_file()
    single = tmp_path / "single"
    assert main(run_args(tiny_model_dir, path, single)) == 0
    got = sorted_rows(out)
    assert [r["row_index"] for r in got] == list(range(60))
    assert [(r["id"], r["completion_token_ids"]) for r in got] == [
        (r["id"], r["completion_token_ids"]) for r in sorted_rows(single)
    ]


def kill_one_replica_once(output_dir, killed: list[int], stop) -> None:
    """SIGKILL one replica process (Ray titles it ``ray::MapWorker(...)``) once the driver has committed a part."""
    import signal

    import psutil

    this_test = psutil.Process()
    while not stop.is_set():
        if any(output_dir.glob("part-*.parquet")):
            for process in this_test.children(recursive=True):  # never another test run's replica
                try:
                    cmdline = " ".join(process.cmdline())
                except psutil.Error:  # gone since the listing
                    continue
                if "MapWorker" in cmdline:
                    process.send_signal(signal.SIGKILL)
                    killed.append(process.pid)
                    return
        stop.wait(0.05)


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_replica_is_restarted_and_its_rows_are_written_once(
    local_ray, stories260k_dir, make_manifest, tmp_path
):
    import threading

    path = tmp_path / "in.parquet"
    num_rows = 400
    pq.write_table(
        pa.table(
            {
                "id": [f"k{i}" for i in range(num_rows)],
                "prompt": [f"Once upon a time, Lily saw {i}" for i in range(num_rows)],
            }
        ),
        path,
    )
    single = make_manifest(stories260k_dir, path, tmp_path / "single", commit_every_rows=16)
    run_job(single, progress=False)
    on_ray = make_manifest(stories260k_dir, path, tmp_path / "ray", commit_every_rows=16)
    on_ray.cluster = ClusterSettings(executor="ray", num_replicas=1, batch_size=8)
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=kill_one_replica_once, args=(tmp_path / "ray", killed, stop), daemon=True)
    killer.start()
    try:
        summary = run_job(on_ray, progress=False)
    finally:
        stop.set()
        killer.join()
    assert killed, "the job finished before a replica could be killed"
    assert summary.num_rows == num_rows and summary.num_errors == 0
    got = sorted_rows(tmp_path / "ray")  # asserts no row was written twice
    assert len(got) == num_rows and got == sorted_rows(tmp_path / "single")


def test_ray_logs_are_quieted_to_warnings_unless_the_environment_says(monkeypatch):
    for name in QUIET_RAY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_BACKEND_LOG_LEVEL", "info")  # the user's choice wins
    levels = {name: logging.getLogger(name).level for name in ("ray", "ray.data")}
    try:
        quiet_ray_logs()
        assert os.environ["RAY_BACKEND_LOG_LEVEL"] == "info"
        assert os.environ["RAY_DATA_LOG_LEVEL"] == "WARNING" and os.environ["RAY_LOGGER_LEVEL"] == "warning"
        assert all(logging.getLogger(name).level == logging.WARNING for name in levels)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_a_tensor_parallel_replica_reserves_every_ranks_share():
    from cbrun.jobs.run.ray_executor import replica_resources

    cpu, cuda = EngineConfig(device="cpu", tensor_parallel_size=2), EngineConfig(tensor_parallel_size=2)
    object.__setattr__(cuda, "device", "cuda:0")  # no CUDA here: only the device name is read
    assert replica_resources(ClusterSettings(num_cpus_per_replica=1), cpu) == (0, 2, 1)
    assert replica_resources(ClusterSettings(num_cpus_per_replica=3), cuda) == (2, 6, 3)
    assert replica_resources(ClusterSettings(num_gpus_per_replica=2), cuda) == (4, 2, 1)
    with pytest.raises(ValueError, match="each rank needs a GPU of its own"):
        replica_resources(ClusterSettings(num_gpus_per_replica=0.5), cuda)
    assert replica_resources(ClusterSettings(num_cpus_per_replica=2), ENGINE_CONFIG) == (0, 2, 2)  # one rank


def watch_ranks(output_dir, seen: set[int], stop, kill_after_first_part: bool) -> None:
    """Collect the pids of tensor-parallel ranks (``RANK_MODULE`` processes descending from this one) while the job
    runs; with ``kill_after_first_part``, SIGKILL the first one seen once the driver has committed a part."""
    import signal

    import psutil

    from cbrun.engine.worker.tp_group import RANK_MODULE

    killed = False
    this_test = psutil.Process()
    while not stop.is_set():
        # NOTE: this process's descendants only (the local Ray instance's raylet, workers and their ranks are):
        # another test run on the machine has rank processes of its own.
        for process in this_test.children(recursive=True):
            try:
                cmdline = " ".join(process.cmdline())
            except psutil.Error:  # gone, or a zombie, since the listing
                continue
            if RANK_MODULE in cmdline:
                seen.add(process.pid)
                if kill_after_first_part and not killed and any(output_dir.glob("part-*.parquet")):
                    process.send_signal(signal.SIGKILL)
                    killed = True
        stop.wait(0.05)


def _run_watching_ranks(args, output_dir, kill_after_first_part: bool = False) -> tuple[int, set[int]]:
    import threading

    seen: set[int] = set()
    stop = threading.Event()
    watcher = threading.Thread(target=watch_ranks, args=(output_dir, seen, stop, kill_after_first_part), daemon=True)
    watcher.start()
    try:
        code = main(args)
    finally:
        stop.set()
        watcher.join()
    return code, seen


def _gone(pids: set[int], timeout_s: float = 10.0) -> bool:
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


def _tp_rows(tiny_model_dir, tmp_path, num_rows: int):
    path = tmp_path / "in.parquet"
    ids, prompts = [f"t{i}" for i in range(num_rows)], [f"row {i} says" for i in range(num_rows)]
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), path)
    assert main(run_args(tiny_model_dir, path, tmp_path / "single")) == 0
    # one replica of 2 ranks: the actor reserves both CPUs of this Ray instance, its rank 1 is its own process
    ray_args = ["--executor", "ray", "--replicas", "1", "--tensor-parallel-size", "2", "--set", "cluster.batch_size=8"]
    return run_args(tiny_model_dir, path, tmp_path / "ray") + ray_args, sorted_rows(tmp_path / "single")


@pytest.mark.ray
def test_a_tensor_parallel_replica_on_ray_equals_the_single_process_run(local_ray, tiny_model_dir, tmp_path):
    args, single = _tp_rows(tiny_model_dir, tmp_path, 24)
    code, ranks = _run_watching_ranks(args, tmp_path / "ray")
    assert code == 0
    assert len(ranks) == 1, "the replica ran no rank process of its own"
    got = sorted_rows(tmp_path / "ray")
    assert [r["row_index"] for r in got] == list(range(24))
    assert [(r["id"], r["completion_token_ids"]) for r in got] == [(r["id"], r["completion_token_ids"]) for r in single]
    assert _gone(ranks), "a rank outlived its job"


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_rank_on_ray_restarts_its_replica_and_every_row_is_written_once(local_ray, tiny_model_dir, tmp_path):
    args, single = _tp_rows(tiny_model_dir, tmp_path, 120)
    code, ranks = _run_watching_ranks(args + ["--set", "output.commit_every_rows=8"], tmp_path / "ray", True)
    assert code == 0
    assert len(ranks) >= 2, "no rank was killed and replaced"  # the killed rank 1, then the restarted replica's
    got = sorted_rows(tmp_path / "ray")  # asserts no row was written twice
    assert [(r["id"], r["completion_token_ids"]) for r in got] == [(r["id"], r["completion_token_ids"]) for r in single]
    assert _gone(ranks)
