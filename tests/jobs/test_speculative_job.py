"""A job with speculative decoding on: llama2.c's goldens unchanged, the speculation counters in stats.json and in
the summary line."""

from __future__ import annotations

import json

from tests.golden_job import run_golden_job


def test_job_with_ngram_speculation_reproduces_goldens(stories260k_dir, reference_greedy, tmp_path, capsys):
    out = tmp_path / "out"
    settings = ["engine.speculative=ngram", "engine.ngram_min=1", "engine.max_batch_tokens=32"]
    rows = run_golden_job(stories260k_dir, reference_greedy, tmp_path, out, settings)
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
