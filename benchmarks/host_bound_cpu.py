"""Greedy against Llama-3 sampling on issue 39's host-bound workload, by CPU seconds, in one process.

On a shared machine wall-clock ratios swing with the load; the CPU seconds a process spends are steadier. The
engine is built once on the workload's model (``cbrun bench --workload host-bound``'s: a 0.36M Llama, 512 rows of
16-48 random ids, 128 new tokens each, ``ignore_eos``), then every setting runs all rows through ``generate``
``--rounds`` times, alternating, after one uncounted warm-up round; each setting's best CPU seconds are compared.
Run it once per tree to compare two commits (alternate the processes).

    PYTHONPATH=. python -m benchmarks.host_bound_cpu --rounds 2
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from cbrun.bench.workloads import build_workload
from cbrun.engine import EngineConfig, LLMEngine, SamplingParams

SETTINGS = {"greedy": {}, "llama3 (0.6 / 0.9)": {"temperature": 0.6, "top_p": 0.9}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="host-bound-cpu-") as tmp:
        workload = build_workload("host-bound", 512, (128, 128), 0, None, Path(tmp))
        config = EngineConfig(page_size=16, max_batch_tokens=4096, max_requests_per_batch=256, num_threads=1)
        engine = LLMEngine.from_pretrained(str(workload.model_dir), config)
        best = {name: float("inf") for name in SETTINGS}
        for round_ in range(-1, args.rounds):  # round -1: a warm-up of each setting, not counted
            for name, fields in SETTINGS.items():
                requests = [
                    (
                        i,
                        prompt,
                        SamplingParams(max_new_tokens=m, ignore_eos=True, **fields, **({"seed": i} if fields else {})),
                    )
                    for i, (prompt, m) in enumerate(zip(workload.prompts, workload.max_new_tokens))
                ]
                start = time.process_time()
                tokens = sum(len(o.output_token_ids) for o in engine.generate(requests, max_in_flight=len(requests)))
                if round_ >= 0:
                    best[name] = min(best[name], time.process_time() - start)
    greedy = best["greedy"]
    print("| setting | best CPU s | generated tok per CPU s | vs greedy |")
    print("|---|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.2f} | {tokens / seconds:,.0f} | {greedy / seconds:.2f}x |")


if __name__ == "__main__":
    main()
