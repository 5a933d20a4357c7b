"""A job with emulated CUDA graphs: llama2.c's goldens unchanged, the graph counters in stats.json."""

from __future__ import annotations

import json

from tests.golden_job import run_golden_job

NEW_TOKENS = 24


def test_job_with_emulated_graphs_reproduces_goldens(stories260k_dir, reference_greedy, tmp_path):
    lines = reference_greedy[:3]
    out = tmp_path / "out"
    # a greedy prefix of each golden, to keep the test short
    settings = ["engine.cuda_graphs=emulate", "engine.max_batch_tokens=32"]
    rows = run_golden_job(stories260k_dir, lines, tmp_path, out, settings, max_new_tokens=NEW_TOKENS)
    for row, line in zip(rows, lines, strict=True):
        assert row["completion_token_ids"] == line["output_token_ids"][:NEW_TOKENS], line["prompt"]
    stats = json.loads((out / "_cbrun" / "stats.json").read_text())["engine_stats"]
    assert 1 <= stats["num_cuda_graph_captures"] <= 3  # buckets 1, 2 and 4 at most
    assert stats["num_cuda_graph_captures"] < stats["num_cuda_graph_replays"] < stats["num_steps"]
