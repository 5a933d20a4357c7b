"""Profile cbrun's step loop on a bench workload with cProfile; print the top costs.

Usage (from the repo root):
    python -m benchmarks.profile_cbrun [--workload gsm8k-stories260k] [--rows 128] [--model-dir DIR] [--top 30]

Builds the workload exactly as ``cbrun bench`` does, runs ``LLMEngine.generate`` over it once unprofiled (warm-up,
also the timing without profiler overhead) and once under cProfile, and prints the functions by own time and by
cumulative time, plus a coarse split of the step: scheduling, input preparation, forward pass, sampling, update.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from cbrun.bench.workloads import build_workload
from cbrun.engine import EngineConfig, LLMEngine, SamplingParams

#: Functions whose cumulative time splits a step into phases.
PHASES = {
    "schedule": ("scheduler.py", "schedule"),
    "prepare inputs": ("step_inputs.py", "prepare"),
    "upload inputs": ("model_runner.py", "_upload"),
    "model forward": ("model_runner.py", "_forward"),
    "  of which paged attention": ("attention.py", "paged_attention"),
    "read results": ("step.py", "read"),
    "scheduler update": ("scheduler.py", "update_from_output"),
}


def run(workload, config: EngineConfig) -> tuple[float, int, int]:
    engine = LLMEngine.from_pretrained(str(workload.model_dir), config)
    requests = [
        (i, p, SamplingParams(max_new_tokens=m, stop_token_ids=workload.stop_token_ids))
        for i, (p, m) in enumerate(zip(workload.prompts, workload.max_new_tokens))
    ]
    start = time.perf_counter()
    tokens = sum(len(o.output_token_ids) for o in engine.generate(requests, max_in_flight=len(requests)))
    return time.perf_counter() - start, engine.stats.num_steps, tokens


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="gsm8k-stories260k")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--max-requests", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=args.max_requests, num_threads=args.threads
    )
    with tempfile.TemporaryDirectory() as scratch:
        workload = build_workload(args.workload, args.rows, (16, 256), 0, args.model_dir, Path(scratch))
        wall, steps, tokens = run(workload, config)
        print(
            f"unprofiled: {tokens} tokens, {steps} steps in {wall:.2f} s = {tokens / wall:.0f} tok/s, "
            f"{1e3 * wall / steps:.1f} ms/step"
        )
        profiler = cProfile.Profile(time.process_time)  # CPU time: robust to other processes on the machine
        profiler.enable()
        wall, steps, tokens = run(workload, config)
        profiler.disable()
    print(f"profiled:   {tokens} tokens, {steps} steps in {wall:.2f} s (profiler overhead included)\n")
    stats = pstats.Stats(profiler)
    print_phases(stats, wall)
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(args.top)
        print(f"---- top {args.top} by {key} ----")
        print(out.getvalue().split("\n", 6)[-1])
    return 0


def print_phases(stats: pstats.Stats, wall: float) -> None:
    """Cumulative CPU time of the step's phases (the forward pass counted at the model runner's ``_forward``), and its
    share of the profiled run's wall time (the same as CPU time on an idle machine, single-threaded)."""
    print(f"{'phase':<28}{'CPU s':>8}   % of run")
    for phase, (file_part, name) in PHASES.items():
        total = 0.0
        for (filename, _, func), (_, _, _, cumulative, callers) in stats.stats.items():
            if func == name and filename.endswith(file_part):
                total += cumulative
        print(f"{phase:<28}{total:>8.2f}   {100 * total / wall:>7.1f}%")
    print()


if __name__ == "__main__":
    sys.exit(main())
