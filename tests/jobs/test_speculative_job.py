"""A job with speculative decoding on: llama2.c's goldens unchanged, the speculation counters in stats.json and in
the summary line."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.cli import main
from jobs.output.writer import read_output


def test_job_with_ngram_speculation_reproduces_goldens(stories260k_dir, reference_greedy, tmp_path, capsys):
    table = pa.table(
        {
            "prompt_ids": [line["prompt_token_ids"] for line in reference_greedy],
            "max_new_tokens": [line["max_positions"] - len(line["prompt_token_ids"]) + 1 for line in reference_greedy],
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
                "engine.speculative=ngram",
                "--set",
                "engine.ngram_min=1",
                "--set",
                "engine.max_batch_tokens=32",
            ]
        )
        == 0
    )
    rows = sorted(read_output(out).to_pylist(), key=lambda r: r["row_index"])
    for row, line in zip(rows, reference_greedy):
        assert row["completion_token_ids"] == line["output_token_ids"], line["prompt"]
    stats = json.loads((out / "_cbrun" / "stats.json").read_text())["engine_stats"]
    assert 0 < stats["num_accepted_tokens"] <= stats["num_proposed_tokens"]
    assert stats["acceptance_rate"] == stats["num_accepted_tokens"] / stats["num_proposed_tokens"]
    assert stats["mean_tokens_per_verify_step"] == 1 + stats["num_accepted_tokens"] / stats["num_verify_steps"]
    captured = capsys.readouterr()
    assert f"proposals accepted, {stats['mean_tokens_per_verify_step']:.2f} tokens per verify step" in (
        captured.out + captured.err
    )
