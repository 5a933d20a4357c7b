"""Safe to run unattended: one writer per output (flock), SIGTERM like SIGINT, a commit that an interrupt at any
line cannot duplicate, exit codes and --retry-errors, faults that are one row's or not, output that standard
readers load, and setup errors for absent resources."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import cbrun.jobs.output.writer
from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.cli import main
from cbrun.jobs.config.manifest import load_manifest
from cbrun.jobs.output.lock import OutputLock
from cbrun.jobs.output.writer import committed_parts
from cbrun.jobs.run.job import JobAborted, JobError, run_job
from tests.jobs.cli_args import keyed_run_argv
from tests.jobs.held_cbrun import HELD_LINE
from tests.jobs.job_files import rows_once, write_prompts

ENGINE_CONFIG = EngineConfig(page_size=8, max_batch_tokens=64, max_requests_per_batch=2, num_blocks=64)
MANIFEST_DEFAULTS = {
    "sampling": SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True),
    "commit_every_rows": 2,
    "id_column": "id",
}


def tokens(rows: dict) -> dict:
    return {key: (r["completion_token_ids"], r["finish_reason"]) for key, r in rows.items()}


def cli_args(model_dir, input_path, out, *extra) -> list[str]:
    sets = [
        "engine.max_requests_per_batch=2",
        "engine.max_batch_tokens=64",
        "engine.num_blocks=64",
        "sampling.ignore_eos=true",
    ]
    return keyed_run_argv(model_dir, input_path, out, 6, sets, "--temperature", "0", *extra)


@pytest.fixture
def reference(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    """A clean run over 9 rows, 2 samples each: {(row_index, sample_index): (token ids, finish reason)}."""
    write_prompts(tmp_path / "in.parquet", 9)
    run_job(
        make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "reference", n=2),
        progress=False,
        engine=tiny_engine,
    )
    return tokens(rows_once(tmp_path / "reference"))


# --- 1. one writer per output ---------------------------------------------------------------------------------


def test_a_second_run_exits_2_naming_the_holder_and_a_dead_holder_never_blocks(tiny_model_dir, tmp_path, capsys):
    write_prompts(tmp_path / "in.parquet", 3)
    out = tmp_path / "out"
    args = cli_args(tiny_model_dir, tmp_path / "in.parquet", out)
    with OutputLock(out):  # another run holds the output
        assert main(args) == 2
    err = capsys.readouterr().err
    assert f"is in use by another cbrun run (host {os.uname().nodename}, pid {os.getpid()}, started " in err
    assert "shard 0/1" in err and not committed_parts(out)

    # a holder killed with SIGKILL leaves its lock file, but not its lock
    code = (
        f"from cbrun.jobs.output.lock import OutputLock; OutputLock({str(out)!r}).acquire(); print('held', flush=True); "
        f"import time; time.sleep(120)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    assert holder.stdout.readline().strip() == "held"
    assert main(args) == 2 and f"pid {holder.pid}" in capsys.readouterr().err
    holder.kill()
    holder.wait()
    assert main(args) == 0
    assert sorted(k[0] for k in rows_once(out)) == [0, 1, 2]


# --- 4. signals, and 14.6: a commit interrupted at any line -------------------------------------------------


@pytest.mark.slow
def test_overlapping_run_is_refused_then_sigterm_and_resume_write_each_row_once(tiny_model_dir, tmp_path, capsys):
    """The issue's examples: the same job started again (other commit size) while the first runs, then SIGTERM."""
    write_prompts(tmp_path / "in.parquet", 60)
    out = tmp_path / "out"
    args = cli_args(tiny_model_dir, tmp_path / "in.parquet", out, "--set", "output.commit_every_rows=20")
    # the job holds after 30 of its 60 rows (one part of 20 committed) until a signal ends it
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.jobs.held_cbrun", "30", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    err_lines = []
    while HELD_LINE.format(30) not in (line := process.stderr.readline()):
        assert line, f"the job ended before it held: {process.wait()} {''.join(err_lines)}"
        err_lines.append(line)
    assert committed_parts(out)
    before = {p.name: pq.read_table(p) for p in committed_parts(out)}
    overlapping = cli_args(tiny_model_dir, tmp_path / "in.parquet", out, "--set", "output.commit_every_rows=13")
    assert main(overlapping) == 2
    assert f"pid {process.pid}, started " in capsys.readouterr().err

    assert process.poll() is None, "the job was not running when signalled"
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    assert (
        "interrupted by SIGTERM: stopped admitting rows; the " in err
        and "output rows this run finished are committed" in err
    )
    assert not (out / "_SUCCESS").exists()
    after_signal = rows_once(out)
    for name, table in before.items():  # rows committed before the signal are kept as they were
        assert pq.read_table(out / name).equals(table)

    assert main(overlapping) == 0
    assert f"{len(after_signal)} skipped" in capsys.readouterr().out  # rows finished before the signal were kept
    got = rows_once(out)
    assert sorted(k[0] for k in got) == list(range(60))
    assert main(args[:6] + [str(tmp_path / "reference")] + args[7:]) == 0
    assert tokens(got) == tokens(rows_once(tmp_path / "reference"))


COMMIT_PATH = {
    (cbrun.jobs.output.writer.__file__, name)
    for name in ("commit", "rows_to_table", "write_part_atomically", "_fsync_dir")
}


def interrupt_at_line(k: int | None):
    """A ``sys.settrace`` function raising KeyboardInterrupt at the k-th line run on the commit path (None: count)."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == k:
                raise KeyboardInterrupt(f"injected at line {frame.f_lineno} of {frame.f_code.co_name}")
        return local

    def tracer(frame, event, arg):
        if (frame.f_code.co_filename, frame.f_code.co_name) in COMMIT_PATH:
            return local
        return None

    return tracer, seen


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # a ParquetWriter cut off mid-way
def test_an_interrupt_at_any_line_of_the_commit_leaves_every_row_once(
    tiny_model_dir, tiny_engine, tmp_path, make_manifest, reference
):
    manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "count", n=2)
    tracer, seen = interrupt_at_line(None)
    sys.settrace(tracer)
    try:
        run_job(manifest, progress=False, engine=tiny_engine)
    finally:
        sys.settrace(None)
    lines_per_commit = seen[0] // len(committed_parts(tmp_path / "count"))
    assert lines_per_commit > 10
    # every line of the first commit, and of a later one (a part already on disk)
    for k in [*range(1, lines_per_commit + 1), 2 * lines_per_commit - 1]:
        manifest.output.path = str(tmp_path / f"out{k}")
        tracer, _ = interrupt_at_line(k)
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt, match="injected"):
                run_job(manifest, progress=False, engine=tiny_engine)
        finally:
            sys.settrace(None)
        rows_once(manifest.output.path)  # the commit's retry on the way out wrote no row twice
        run_job(manifest, progress=False, engine=tiny_engine)
        assert tokens(rows_once(manifest.output.path)) == reference, f"interrupted at line {k}"


# --- 3. exit codes and --retry-errors; 5. per-row and whole-job faults ----------------------------------------


class _FaultyEngine:
    """The tiny engine, failing chosen requests alone (as the engine does for a per-request fault), or raising a
    whole-engine fault after a number of outputs."""

    def __init__(self, engine, fail: set = frozenset(), raise_after: int | None = None):
        self.engine, self.fail, self.raise_after = engine, fail, raise_after

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, max_in_flight):
        for count, output in enumerate(self.engine.generate(requests, max_in_flight=max_in_flight)):
            if count == self.raise_after:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            if output.request_id in self.fail:
                output = dataclasses.replace(
                    output,
                    output_token_ids=[],
                    finish_reason="error",
                    error="probability tensor contains either inf, nan or element < 0",
                )
            yield output


def test_a_failed_request_is_its_row_error_and_retry_errors_replaces_it(
    tiny_model_dir, tiny_engine, tmp_path, make_manifest, reference
):
    manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", n=2)
    flaky = _FaultyEngine(tiny_engine, fail={(3, 1), (5, 0)})
    summary = run_job(manifest, progress=False, engine=flaky)
    got = rows_once(tmp_path / "out")
    assert got[(3, 1)]["error"] == "row 3 (id 'r3'): probability tensor contains either inf, nan or element < 0"
    assert {k: v for k, v in tokens(got).items() if k not in {(3, 1), (5, 0)}} == {
        k: v for k, v in reference.items() if k not in {(3, 1), (5, 0)}
    }  # the other rows are unaffected
    assert (summary.total_error_rows, summary.total_output_rows, summary.exit_code) == (2, 18, 3)  # 11% > 10%
    assert "too many errors (exit code 3): 2 of 18 output rows in" in summary.line()
    manifest.output.max_error_fraction = 0.2
    again = run_job(manifest, progress=False, engine=tiny_engine)
    assert again.already_finished and again.exit_code == 0 and "2 of 18 output rows" in again.line()

    retried = run_job(manifest, progress=False, engine=tiny_engine, retry_errors=True)
    assert (retried.num_skipped, retried.num_rows, retried.total_error_rows, retried.exit_code) == (7, 2, 0, 0)
    assert tokens(rows_once(tmp_path / "out")) == reference  # each row once, errors replaced


def test_all_rows_failing_is_exit_3_whatever_the_budget(tiny_model_dir, tmp_path, capsys):
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": pa.array([None, None], pa.string())}), tmp_path / "in.parquet")
    args = cli_args(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "--set", "output.max_error_fraction=1.0")
    assert main(args) == 3
    assert "too many errors (exit code 3): 2 of 2 output rows" in capsys.readouterr().out
    assert main(args) == 3  # and again when it finds the job finished


def test_a_fault_that_is_not_one_rows_stops_the_job_with_finished_rows_committed(
    tiny_model_dir, tiny_engine, tmp_path, make_manifest, reference
):
    manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", n=2)
    with pytest.raises(
        JobAborted,
        match=r"not one row's: RuntimeError: CUDA error.*the 8 output rows this run "
        r"finished are committed",
    ) as caught:
        run_job(manifest, progress=False, engine=_FaultyEngine(tiny_engine, raise_after=8))
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert len(rows_once(tmp_path / "out")) == 8 and not (tmp_path / "out" / "_SUCCESS").exists()
    summary = run_job(manifest, progress=False, engine=tiny_engine)  # the lock was released; resume
    assert summary.num_skipped == 4 and tokens(rows_once(tmp_path / "out")) == reference


# --- 6. output that standard tools read -------------------------------------------------------------------------


def test_the_output_folder_loads_with_pyarrow_pandas_datasets_and_duckdb(
    tiny_model_dir, tiny_engine, tmp_path, make_manifest
):
    import datasets
    import pandas as pd

    duckdb = pytest.importorskip("duckdb")

    write_prompts(tmp_path / "in.parquet", 5)
    for name, logprobs in (("plain", None), ("logprobs", 2)):
        manifest = make_manifest(
            tiny_model_dir,
            tmp_path / "in.parquet",
            tmp_path / name,
            sampling=SamplingParams(max_new_tokens=3, logprobs=logprobs),
        )
        run_job(manifest, progress=False, engine=tiny_engine)
        out = str(tmp_path / name)
        assert sorted(pq.read_table(out).column("row_index").to_pylist()) == list(range(5))
        assert sorted(pd.read_parquet(out)["row_index"]) == list(range(5))
        loaded = datasets.load_dataset(
            "parquet", data_files=out + "/part-*.parquet", split="train", cache_dir=str(tmp_path / "hf-cache")
        )
        assert sorted(loaded["row_index"]) == list(range(5))
        count = duckdb.sql(f"select count(*) from read_parquet('{out}/*.parquet')").fetchall()[0][0]
        assert count == 5
        if logprobs:
            step = loaded[0]["logprobs"][0]
            assert 2 <= len(step) <= 3 and set(step[0]) == {"token_id", "logprob"}


# --- 7. setup errors --------------------------------------------------------------------------------------------


def test_device_defaults_to_auto_and_an_absent_device_is_a_setup_error(tiny_model_dir, tmp_path, capsys):
    write_prompts(tmp_path / "in.parquet", 2)
    args = cli_args(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out")
    manifest = load_manifest(
        None, [], {"model": {"path": "m"}, "input": {"path": "i", "prompt_column": "p"}, "output": {"path": "o"}}
    )
    assert manifest.engine.device == "auto"
    for device, message in [("meta", "is not available here"), ("nonsense", "is not a device name")] + (
        [] if torch.cuda.is_available() else [("cuda", "has no usable CUDA device")]
    ):
        assert main(args + ["--set", f"engine.device={device}"]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    assert main(cli_args(tmp_path / "no-weights", tmp_path / "in.parquet", tmp_path / "out")) == 2
    assert "holds no weights" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("x")
    assert main(cli_args(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "a-file" / "out")) == 2
    assert "cannot create the output directory" in capsys.readouterr().err


def test_setup_error_for_an_output_that_is_a_file(tiny_model_dir, tmp_path):
    write_prompts(tmp_path / "in.parquet", 2)
    (tmp_path / "out").write_text("x")
    with pytest.raises(JobError, match="exists and is not a directory"):
        run_job(
            load_manifest(
                None,
                [],
                {
                    "model": {"path": str(tiny_model_dir)},
                    "input": {"path": str(tmp_path / "in.parquet"), "prompt_column": "prompt"},
                    "output": {"path": str(tmp_path / "out")},
                },
            ),
            progress=False,
        )
