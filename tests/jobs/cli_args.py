"""The ``cbrun run`` command lines the job tests build (``run_argv``, ``keyed_run_argv``), and their subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path


def run_argv(model_dir: str | Path, input_path: str | Path, output_dir: str | Path, *options: str) -> list[str]:
    """``["run", "--model", M, "--input", I, "--output", O, *options]`` (``main``'s argv, without the program)."""
    return ["run", "--model", str(model_dir), "--input", str(input_path), "--output", str(output_dir), *options]


def keyed_run_argv(
    model_dir: str | Path,
    input_path: str | Path,
    output_dir: str | Path,
    max_new_tokens: int,
    sets: Iterable[str] = (),
    *options: str,
) -> list[str]:
    """``run_argv`` over an input of ``id`` and ``prompt`` columns (``job_files.write_prompts``): ``max_new_tokens``
    new tokens, no progress bar, each of ``sets`` (``"section.key=value"``) as a ``--set``, then ``options``."""
    keyed = ["--prompt-column", "prompt", "--id-column", "id", "--max-new-tokens", str(max_new_tokens), "--no-progress"]
    return run_argv(model_dir, input_path, output_dir, *keyed, *[arg for s in sets for arg in ("--set", s)], *options)


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL the session ``process`` was started in (``start_new_session=True``): it and whatever it started (a
    local Ray instance, say); a session already gone is fine."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
