"""``cbrun run --data-parallel-size 2`` for real on the CPU: two replica processes, each a shard of the job on its
own cores, write the rows of one run into one output directory, each row once; what it does not combine with is
exit 2 by name before any replica starts."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.jobs.cli import main
from cbrun.jobs.output.writer import committed_parts
from cbrun.jobs.run.data_parallel import cpu_groups, replica_argv, replica_device
from tests.jobs.test_resume import rows_by_index, run_args


def _input(tmp_path, num_rows: int):
    path = tmp_path / "in.parquet"
    ids = [f"r{i}" for i in range(num_rows)]
    pq.write_table(pa.table({"id": ids, "prompt": [f"row {i} says" for i in range(num_rows)]}), path)
    return path


def test_two_replicas_write_the_rows_of_one_run_once(tiny_model_dir, tmp_path, capsys):
    input_path = _input(tmp_path, 10)
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(run_args(tiny_model_dir, input_path, one)) == 0
    assert main(run_args(tiny_model_dir, input_path, two) + ["--data-parallel-size", "2"]) == 0
    got = rows_by_index(two)  # asserts no row is written twice
    assert got == rows_by_index(one)
    names = sorted(p.name for p in committed_parts(two))
    assert any("s0000of0002" in n for n in names) and any("s0001of0002" in n for n in names), names
    assert (two / "_SUCCESS").exists()
    # a rerun of the same command has nothing left to do in either replica
    assert main(run_args(tiny_model_dir, input_path, two) + ["--data-parallel-size", "2"]) == 0
    assert rows_by_index(two) == got


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--shard", "0/2"], "cluster.data_parallel_size = 2 runs shards 0..1 itself; it does not run with --shard"),
        (["--executor", "ray"], "with --executor ray set cluster.num_replicas"),
        (["--set", 'engine.device="cuda"'], "engine.device = 'cuda'"),
    ],
    ids=["shard", "ray", "no-cuda"],
)
def test_what_data_parallelism_does_not_combine_with_is_exit_2(tiny_model_dir, tmp_path, capsys, extra, named):
    import torch

    if extra[-1].endswith('"cuda"') and torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")  # the refusal under test is for a machine without them
    out = tmp_path / "out"
    assert main(run_args(tiny_model_dir, _input(tmp_path, 2), out) + ["--data-parallel-size", "2", *extra]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


def test_run_job_itself_refuses_more_than_one_replica(tiny_model_dir, tmp_path):
    from cbrun.jobs.config.manifest import load_manifest
    from cbrun.jobs.run.job import JobError, run_job

    manifest = load_manifest(
        None,
        [],
        {
            "model": {"path": str(tiny_model_dir)},
            "input": {"path": str(_input(tmp_path, 2)), "prompt_column": "prompt"},
            "output": {"path": str(tmp_path / "out")},
            "cluster": {"data_parallel_size": 2},
        },
    )
    with pytest.raises(JobError, match="run_job runs one replica"):
        run_job(manifest)


def test_each_replica_gets_its_shard_devices_and_cores():
    assert replica_argv(["run", "--model", "m"], 1, 2, "cuda:2")[3:] == [
        "--shard",
        "1/2",
        "--data-parallel-size",
        "1",
        "--set",
        'engine.device="cuda:2"',
        "--no-progress",
    ]
    assert [replica_device("cuda:1", i, 2) for i in range(3)] == ["cuda:1", "cuda:3", "cuda:5"]
    assert replica_device("cpu", 1, 2) == "cpu"
    # 4 physical cores with their hyperthread siblings, over 2 replicas: two whole cores each
    assert cpu_groups([[0, 4], [1, 5], [2, 6], [3, 7]], 2) == [{0, 4, 1, 5}, {2, 6, 3, 7}]
    assert cpu_groups([[0], [1], [2]], 2) == [{0}, {1, 2}]
    assert cpu_groups([[0], [1]], 3) == [{0}, {1}, {0}]  # fewer cores than replicas: shared


def _replica_pids(pid: int) -> list[int]:
    from pathlib import Path

    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _replica_pid(pid: int, shard: str) -> int:
    """The pid of the command's replica running ``--shard SHARD`` (by its command line: the other replica may
    already have finished and left the list of children)."""
    from pathlib import Path

    for child in _replica_pids(pid):
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if shard.encode() in argv:
            return int(child)
    raise AssertionError(f"no replica of pid {pid} runs --shard {shard}")


def test_a_killed_replica_fails_the_command_by_name_and_a_rerun_finishes_every_row_once(tiny_model_dir, tmp_path):
    import os
    import signal
    import subprocess
    import time

    from tests.jobs.test_resume import cbrun_command

    num_rows = 150
    out = tmp_path / "out"
    args = run_args(tiny_model_dir, _input(tmp_path, num_rows), out) + ["--data-parallel-size", "2"]
    process = subprocess.Popen(cbrun_command() + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any("s0001of0002" in p.name for p in committed_parts(out)):
            assert process.poll() is None and time.monotonic() < deadline, "replica 1 committed nothing in time"
            time.sleep(0.01)
        os.kill(_replica_pid(process.pid, "1/2"), signal.SIGKILL)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGKILL, stderr
    assert f"replica 1 (shard 1/2) exited with code {128 + signal.SIGKILL}" in stderr
    committed = rows_by_index(out)
    assert 0 < len(committed) < num_rows

    resumed = subprocess.run(cbrun_command() + args, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    got = rows_by_index(out)
    assert sorted(got) == list(range(num_rows))
    assert {i: got[i] for i in committed} == committed
    assert (out / "_SUCCESS").exists()


def test_sigterm_reaches_every_replica_and_the_command_exits_143(tiny_model_dir, tmp_path):
    import signal
    import subprocess
    import time

    from tests.jobs.test_resume import cbrun_command

    out = tmp_path / "out"
    args = run_args(tiny_model_dir, _input(tmp_path, 400), out) + ["--data-parallel-size", "2"]
    process = subprocess.Popen(cbrun_command() + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not committed_parts(out):
            assert process.poll() is None and time.monotonic() < deadline, "nothing was committed in time"
            time.sleep(0.01)
        replicas = _replica_pids(process.pid)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    # the replica that was generating committed its finished rows (the other may still have been loading, and a
    # replica killed by the signal before its handler is in place exits 143 too)
    assert "output rows this run finished are committed" in stderr
    assert stderr.rstrip().endswith(
        "cbrun: interrupted by SIGTERM: stopped admitting rows; rerun the same command to resume"
    )
    assert all(not os_pid_alive(pid) for pid in replicas)


def os_pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
