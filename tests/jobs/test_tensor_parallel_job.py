"""``cbrun run --tensor-parallel-size 2`` for real: the output equals one rank's, each row written once; what a
replica cannot run is exit 2 by name; killing a rank mid-job ends the run non-zero within 60 s, its committed rows
kept, and a rerun finishes every row once; killing the run itself takes its ranks with it (no orphan left)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.worker.tp_group import RANK_MODULE
from cbrun.jobs.cli import main
from cbrun.jobs.output.writer import committed_parts
from tests.jobs.test_resume import cbrun_command, rows_by_index, run_args


def _input(tmp_path: Path, num_rows: int) -> Path:
    path = tmp_path / "in.parquet"
    ids = [f"r{i}" for i in range(num_rows)]
    pq.write_table(pa.table({"id": ids, "prompt": [f"row {i} says" for i in range(num_rows)]}), path)
    return path


def test_two_ranks_write_the_rows_of_one_once(tiny_model_dir, tmp_path):
    input_path = _input(tmp_path, 12)
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    assert main(run_args(tiny_model_dir, input_path, one)) == 0
    assert main(run_args(tiny_model_dir, input_path, two) + ["--tensor-parallel-size", "2"]) == 0
    got = rows_by_index(two)  # asserts no row is written twice
    assert sorted(got) == list(range(12))
    assert got == rows_by_index(one)


TP2 = ["--tensor-parallel-size", "2"]


@pytest.mark.parametrize(
    "extra, named",
    [
        (
            TP2 + ["--set", 'engine.speculative="ngram"'],
            "engine.tensor_parallel_size = 2 does not run with engine.speculative",
        ),
        (
            TP2 + ["--set", 'engine.speculative="draft"', "--set", 'engine.draft_model="{model}"'],
            "engine.tensor_parallel_size = 2 does not run with engine.speculative",
        ),
        (
            TP2 + ["--set", 'engine.loader="transformers"'],
            "engine.tensor_parallel_size = 2 does not run with engine.loader",
        ),
        (
            TP2 + ["--set", 'engine.model_impl="transformers"'],
            "engine.tensor_parallel_size = 2 does not run with engine.model_impl",
        ),
        (
            TP2 + ["--set", 'engine.batch_invariant="on"'],
            "engine.tensor_parallel_size = 2 does not run with engine.batch_invariant",
        ),
        (
            TP2 + ["--set", 'engine.cuda_graphs="emulate"'],
            "engine.tensor_parallel_size = 2 does not run with engine.cuda_graphs",
        ),
        # the tiny model's 4 attention heads do not split over 3 ranks
        (
            ["--tensor-parallel-size", "3"],
            "tensor_parallel_size = 3 cannot split this model: num_attention_heads = 4 is not a multiple",
        ),
    ],
    ids=["ngram", "draft", "loader", "model-impl", "batch-invariant", "cuda-graphs", "heads"],
)
def test_what_a_replica_cannot_run_is_exit_2_by_name(tiny_model_dir, tmp_path, capsys, extra, named):
    out = tmp_path / "out"
    extra = [arg.replace("{model}", str(tiny_model_dir)) for arg in extra]
    assert main(run_args(tiny_model_dir, _input(tmp_path, 2), out) + extra) == 2
    assert named in capsys.readouterr().err
    assert not out.exists() or not committed_parts(out)


def test_a_quantized_split_off_the_blocks_is_exit_2_by_name(tiny_model_dir, tmp_path, capsys):
    from tests.engine.model.test_quantization import _quantized_copy

    model, _ = _quantized_copy(tiny_model_dir, "fp8-block")  # 128 x 128 blocks over a hidden size of 64
    out = tmp_path / "out"
    assert main(run_args(model, _input(tmp_path, 2), out) + TP2) == 2
    err = capsys.readouterr().err
    assert "tensor_parallel_size = 2 cannot split this model: the quantized weight model.layers.0." in err
    assert "a rank's slice must start on a multiple of 128: one scale per 128 x 128 block" in err
    assert not out.exists() or not committed_parts(out)


def test_a_sampled_job_runs_its_ranks_without_batch_invariance(tiny_model_dir):
    from cbrun.engine import EngineConfig
    from cbrun.engine.worker.backends import batch_invariant_blocker_before_load

    reason = batch_invariant_blocker_before_load(EngineConfig(tensor_parallel_size=2), str(tiny_model_dir), "float32")
    assert reason == "tensor_parallel_size = 2 (the ranks' partial sums are not batch-invariant)"
    assert batch_invariant_blocker_before_load(EngineConfig(), str(tiny_model_dir), "float32") is None


def _rank_pids(pid: int) -> list[int]:
    """The pids of the tensor-parallel ranks ``pid`` started (its children running ``RANK_MODULE``)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    ranks = []
    for child in children:
        try:
            if RANK_MODULE in Path(f"/proc/{child}/cmdline").read_bytes().decode():
                ranks.append(int(child))
        except OSError:
            pass
    return ranks


def test_a_killed_rank_ends_the_run_within_60_s_and_a_rerun_finishes_every_row_once(tiny_model_dir, tmp_path):
    num_rows = 150
    input_path = _input(tmp_path, num_rows)
    out = tmp_path / "out"
    args = run_args(tiny_model_dir, input_path, out) + ["--tensor-parallel-size", "2"]
    process = subprocess.Popen(cbrun_command() + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not committed_parts(out):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no part was committed in time"
            time.sleep(0.01)
        (rank,) = _rank_pids(process.pid)
        os.kill(rank, signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = process.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, stderr
    assert f"tensor-parallel replica stopped: rank 1 (pid {rank}) exited with code -{int(signal.SIGKILL)}" in stderr
    committed = rows_by_index(out)
    assert 0 < len(committed) < num_rows, "the job finished before the rank was killed"

    resumed = subprocess.run(cbrun_command() + args, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(committed)} skipped" in resumed.stdout
    got = rows_by_index(out)
    assert sorted(got) == list(range(num_rows))
    assert {i: got[i] for i in committed} == committed


def _is_gone(pid: int) -> bool:
    """The process has exited (no such pid, or a zombie its new parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_killing_the_run_ends_its_ranks(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    args = run_args(tiny_model_dir, _input(tmp_path, 150), out) + ["--tensor-parallel-size", "2"]
    process = subprocess.Popen(cbrun_command() + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rank = None
    try:
        deadline = time.monotonic() + 120
        while not committed_parts(out):  # the ranks are serving steps
            assert process.poll() is None and time.monotonic() < deadline, "no part was committed in time"
            time.sleep(0.01)
        (rank,) = _rank_pids(process.pid)
        # a stuck rank (stopped: it cannot notice its closed connections) and a run killed outright (no atexit,
        # no close): only the kernel's parent-death signal can end the rank
        os.kill(rank, signal.SIGSTOP)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not _is_gone(rank):
            assert time.monotonic() < deadline, f"rank 1 (pid {rank}) outlived the killed run"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
        if rank is not None and not _is_gone(rank):  # the test failed: leave nothing behind either
            os.kill(rank, signal.SIGKILL)
