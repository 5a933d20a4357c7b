"""Resume for real: SIGKILL a `cbrun run` process after its first commit, rerun it, and compare with a clean run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.cli import main
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from cbrun.jobs.output.writer import committed_parts
from cbrun.jobs.run.job import run_job
from tests.jobs.cli_args import keyed_run_argv, kill_session
from tests.jobs.job_files import write_prompts

NUM_ROWS = 12
MAX_NEW_TOKENS = 8
ENGINE = {"max_requests_per_batch": 2, "max_batch_tokens": 64, "num_blocks": 32}


def cbrun_command() -> list[str]:
    script = Path(sys.executable).with_name("cbrun")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "cbrun.jobs.cli"]


def run_args(model_dir, input_path, output_dir) -> list[str]:
    sets = [f"engine.{k}={v}" for k, v in ENGINE.items()] + ["sampling.ignore_eos=true", "output.commit_every_rows=2"]
    return keyed_run_argv(model_dir, input_path, output_dir, MAX_NEW_TOKENS, sets, "--temperature", "0")


def rows_by_index(output_dir) -> dict[int, list[int]]:
    rows = [r for p in committed_parts(output_dir) for r in pq.read_table(p).to_pylist()]
    by_index = {r["row_index"]: r["completion_token_ids"] for r in rows}
    assert len(by_index) == len(rows), "a row was written twice"
    return by_index


def kill_after_first_commit(args: list[str], out: Path, timeout_s: float = 120) -> None:
    """Start ``cbrun`` with ``args`` in a real subprocess and SIGKILL it as soon as a part file is committed.

    The process runs in a session of its own, and whatever it started (a local Ray instance, say) is killed with it
    through that session's process group."""
    process = subprocess.Popen(
        cbrun_command() + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not committed_parts(out):
            assert process.poll() is None, process.stdout.read().decode()
            assert time.monotonic() < deadline, "no part was committed in time"
            time.sleep(0.01)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    finally:
        kill_session(process)
    assert process.returncode == -signal.SIGKILL
    assert not (out / "_SUCCESS").exists(), "the job finished before it could be killed"


def test_killed_run_resumes_without_duplicates_or_losses(tiny_model_dir, tmp_path, capsys):
    input_path = tmp_path / "in.parquet"
    write_prompts(input_path, NUM_ROWS)
    out = tmp_path / "out"
    args = run_args(tiny_model_dir, input_path, out)

    kill_after_first_commit(args, out)
    killed_rows = rows_by_index(out)
    assert 0 < len(killed_rows) < NUM_ROWS

    resumed = subprocess.run(cbrun_command() + args, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"({0} errors, {len(killed_rows)} skipped)" in resumed.stdout
    assert (out / "_SUCCESS").is_file()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]

    reference = JobManifest(
        model=ModelSettings(path=str(tiny_model_dir)),
        input=InputSettings(path=str(input_path), prompt_column="prompt", id_column="id"),
        sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True),
        engine=EngineConfig(**ENGINE),
        output=OutputSettings(path=str(tmp_path / "reference")),
    )
    run_job(reference, progress=False)
    expected = rows_by_index(tmp_path / "reference")
    got = rows_by_index(out)
    assert sorted(got) == list(range(NUM_ROWS))
    assert got == expected
    assert all(len(ids) == MAX_NEW_TOKENS for ids in got.values())
    assert {i: got[i] for i in killed_rows} == killed_rows  # committed rows were kept, not recomputed

    # The same output directory refuses a job with another fingerprint.
    changed = list(args)
    changed[changed.index("--max-new-tokens") + 1] = "5"
    assert main(changed) == 2
    assert "holds the results of a different job (changed: sampling.max_new_tokens)" in capsys.readouterr().err
    assert rows_by_index(out) == expected
