"""llama2.c's goldens through the whole job path: Parquet in, ``cbrun run``, Parquet out."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.jobs.cli import main
from cbrun.jobs.output.output_dir import read_output


def golden_max_new_tokens(line: dict) -> int:
    """llama2.c runs positions 0 .. max_positions - 1: at most max_positions - len(prompt) + 1 new tokens."""
    return line["max_positions"] - len(line["prompt_token_ids"]) + 1


def run_golden_job(
    model_dir: Path, lines: list[dict], workdir: Path, out: Path, settings: list[str], max_new_tokens: int | None = None
) -> list[dict]:
    """Run ``cbrun run`` over the golden ``lines`` (their prompt ids; ``max_new_tokens`` each, or as many as llama2.c
    generated) with ``--set`` ``settings``; asserts exit 0 and returns the output rows in input order."""
    table = pa.table(
        {
            "prompt_ids": [line["prompt_token_ids"] for line in lines],
            "max_new_tokens": [max_new_tokens or golden_max_new_tokens(line) for line in lines],
        }
    )
    pq.write_table(table, workdir / "goldens.parquet")
    args = ["run", "--no-progress", "--model", str(model_dir), "--input", str(workdir / "goldens.parquet")]
    args += ["--prompt-ids-column", "prompt_ids", "--output", str(out)]
    for setting in settings:
        args += ["--set", setting]
    assert main(args) == 0
    return sorted(read_output(out).to_pylist(), key=lambda r: r["row_index"])
