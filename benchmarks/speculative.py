"""Speculative decoding (n-gram lookup) on a workload whose outputs repeat their inputs: stories260K continuing a
story it already told in the prompt.

Usage (from the repo root; converts stories260K from ../shared into a temporary directory):

    python -m benchmarks.speculative [--repeats 3] [--batches 1 8 128] [--out benchmarks/results-speculative.md]

Workload: each of llama2.c's 12 greedy goldens for stories260K is a told story (prompt + output, the stop token
dropped). A request's prompt is that story, then BOS and the story's first ``m`` tokens again; it asks for the rest
of the story (capped at the 512-token context), greedy, stopping at BOS as llama2.c does. ``m`` runs over 4, 8, 12,
... so each batch size has enough requests (12 at batch 1, 24 at batch 8, 132 at batch 128).

Each (batch size, mode) run builds a fresh engine (one CPU thread, default settings otherwise, so
``speculative_max_batch`` = 16 switches speculation off while more requests run) and times ``generate`` from the
first request to the last output. The runs are interleaved (off, ngram, off, ngram, ...) ``--repeats`` times, since
the machine's speed drifts; the table gives each mode's median generated tokens/s and the ratio of the medians, and
checks that ngram's outputs equal off's token for token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jobs.convert_llama2c import convert_llama2c  # noqa: E402

STORIES = REPO_ROOT.parent / "shared" / "models" / "stories260K"
BOS = 1
MAX_LEN = 512
MODES = ("off", "ngram")


def build_requests(num_requests: int) -> list[tuple[int, list[int], SamplingParams]]:
    """``num_requests`` story-continuation requests (see the module docstring)."""
    lines = [json.loads(s) for s in (STORIES / "reference_greedy.jsonl").read_text().splitlines() if s.strip()]
    stories = [[t for t in line["prompt_token_ids"] + line["output_token_ids"] if t != BOS] for line in lines]
    requests, m = [], 4
    while len(requests) < num_requests:
        for story in stories:
            prompt = [BOS] + story + [BOS] + story[:m]
            max_new = min(len(story) - m, MAX_LEN - len(prompt))
            if max_new > 0 and len(requests) < num_requests:
                params = SamplingParams(max_new_tokens=max_new, stop_token_ids=(BOS,))
                requests.append((len(requests), prompt, params))
        m += 4
    return requests


def run_once(model_dir: Path, mode: str, batch: int, requests) -> dict:
    config = EngineConfig(max_requests_per_batch=batch, speculative=mode, num_threads=1, num_blocks=4096)
    engine = LLMEngine.from_pretrained(str(model_dir), config)
    start = time.perf_counter()
    outputs = {o.request_id: o.output_token_ids for o in engine.generate(requests)}
    seconds = time.perf_counter() - start
    stats = engine.stats
    generated = sum(len(t) for t in outputs.values())
    return dict(outputs=outputs, seconds=seconds, tok_s=generated / seconds, generated=generated,
                steps=stats.num_steps, acceptance=stats.acceptance_rate,
                per_verify=stats.mean_tokens_per_verify_step)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 128])
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin",
                                Path(tempfile.mkdtemp(prefix="stories260K-")))
    rows = ["| batch | requests | off tok/s | ngram tok/s | ngram / off | steps off / ngram | acceptance | "
            "tokens per verify step | outputs equal |", "|---|---|---|---|---|---|---|---|---|"]
    for batch in args.batches:
        requests = build_requests({1: 12, 8: 24}.get(batch, max(batch, 24) + 4))
        runs = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode].append(run_once(model_dir, mode, batch, requests))
                print(f"batch {batch} {mode}: {runs[mode][-1]['tok_s']:.0f} tok/s", file=sys.stderr)
        med = {mode: statistics.median(r["tok_s"] for r in runs[mode]) for mode in MODES}
        equal = all(r["outputs"] == runs["off"][0]["outputs"] for mode in MODES for r in runs[mode])
        ngram = runs["ngram"][0]
        rows.append(f"| {batch} | {len(requests)} | {med['off']:.0f} | {med['ngram']:.0f} | "
                    f"{med['ngram'] / med['off']:.2f}x | {runs['off'][0]['steps']} / {ngram['steps']} | "
                    f"{100 * ngram['acceptance']:.1f}% | {ngram['per_verify']:.2f} | {'yes' if equal else 'NO'} |")
    table = "\n".join(rows)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
