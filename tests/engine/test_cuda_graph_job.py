"""A job with emulated CUDA graphs: llama2.c's goldens unchanged, the graph counters in stats.json."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.cli import main
from jobs.output.writer import read_output

NEW_TOKENS = 24


def test_job_with_emulated_graphs_reproduces_goldens(stories260k_dir, reference_greedy, tmp_path):
    lines = reference_greedy[:3]
    table = pa.table(
        {
            "prompt_ids": [line["prompt_token_ids"] for line in lines],
            "max_new_tokens": [NEW_TOKENS] * len(lines),  # a greedy prefix of the golden, to keep the test short
        }
    )
    pq.write_table(table, tmp_path / "goldens.parquet")
    out = tmp_path / "out"
    assert (
        main(
            [
                "run",
                "--no-progress",
                "--model",
                str(stories260k_dir),
                "--input",
                str(tmp_path / "goldens.parquet"),
                "--prompt-ids-column",
                "prompt_ids",
                "--output",
                str(out),
                "--set",
                "engine.cuda_graphs=emulate",
                "--set",
                "engine.max_batch_tokens=32",
            ]
        )
        == 0
    )
    rows = sorted(read_output(out).to_pylist(), key=lambda r: r["row_index"])
    for row, line in zip(rows, lines, strict=True):
        assert row["completion_token_ids"] == line["output_token_ids"][:NEW_TOKENS], line["prompt"]
    stats = json.loads((out / "_cbrun" / "stats.json").read_text())["engine_stats"]
    assert 1 <= stats["num_cuda_graph_captures"] <= 3  # buckets 1, 2 and 4 at most
    assert stats["num_cuda_graph_captures"] < stats["num_cuda_graph_replays"] < stats["num_steps"]
