"""Greedy against sampled rows on one engine in one process, interleaved: issue 30's ratio without process noise.

``random-llama-100m``'s rows (``cbrun bench``'s workload: about 100M parameters, vocab 32000, ``ignore_eos``, so
every setting generates the same tokens), run greedy, temperature 0.8 / top_p 0.95, and the same plus
repetition_penalty 1.1 and logprobs 5, three rounds round-robin after one warm-up run; prints the best and median
wall time of each and its ratio to greedy's best.

    PYTHONPATH=. python -m benchmarks.sampling_ab --model-dir /tmp/random-llama-100m
"""

import argparse
import time
from pathlib import Path

import torch

from cbrun.bench.workloads import build_workload
from cbrun.engine import EngineConfig, LLMEngine, SamplingParams

KINDS = {
    "greedy": {},
    "temperature 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "+ repetition_penalty 1.1, logprobs 5": {
        "temperature": 0.8,
        "top_p": 0.95,
        "repetition_penalty": 1.1,
        "logprobs": 5,
    },
}


def run(engine, workload, extra: dict) -> tuple[int, float]:
    """(generated tokens, wall seconds) of one ``generate`` over the workload's rows, row i seeded i."""
    requests = [
        (i, p, SamplingParams(max_new_tokens=m, ignore_eos=True, **({**extra, "seed": i} if extra else {})))
        for i, (p, m) in enumerate(zip(workload.prompts, workload.max_new_tokens))
    ]
    start = time.perf_counter()
    outputs = list(engine.generate(requests))
    return sum(len(o.output_token_ids) for o in outputs), time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="built there when it has no config.json")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    workload = build_workload(
        "random-llama-100m", args.rows, (args.new_tokens, args.new_tokens), 0, args.model_dir, args.model_dir.parent
    )
    engine = LLMEngine.from_pretrained(
        str(workload.model_dir),
        EngineConfig(max_requests_per_batch=256, max_batch_tokens=2048, num_threads=args.threads),
    )
    run(engine, workload, {})  # warm-up
    times = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind, extra in KINDS.items():
            generated, seconds = run(engine, workload, extra)
            times[kind].append(seconds)
    base = min(times["greedy"])
    print(
        f"{args.rows} rows, {workload.num_prompt_tokens} prompt tokens, {generated} generated tokens per run, "
        f"{args.threads} threads, {args.rounds} rounds\n"
    )
    print("| setting | best s | median s | generated tok/s (best) | vs greedy |")
    print("|---|---|---|---|---|")
    for kind, values in times.items():
        best, median = min(values), sorted(values)[len(values) // 2]
        print(f"| {kind} | {best:.2f} | {median:.2f} | {generated / best:.1f} | {base / best:.2f}x |")


if __name__ == "__main__":
    main()
