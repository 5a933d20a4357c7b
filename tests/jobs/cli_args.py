"""The ``cbrun run`` command line the job tests build: ``run_argv``."""

from __future__ import annotations

from pathlib import Path


def run_argv(model_dir: str | Path, input_path: str | Path, output_dir: str | Path, *options: str) -> list[str]:
    """``["run", "--model", M, "--input", I, "--output", O, *options]`` (``main``'s argv, without the program)."""
    return ["run", "--model", str(model_dir), "--input", str(input_path), "--output", str(output_dir), *options]
