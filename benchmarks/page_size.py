"""The KV page size on the CPU: generation phase of a bench workload at several ``page_size`` values.

Usage (from the repo root, after ``cbrun convert-llama2c ... models/stories260K``):
    python -m benchmarks.page_size [--workload gsm8k-long] [--rows 256] [--page-sizes 16,32,64,128] [--repeats 3]
        [--markdown benchmarks/results-page-size.md]

Each repeat runs ``LLMEngine.generate`` over the workload once per page size, round-robin, with the engine's
defaults otherwise (``EngineConfig(page_size=P)``: its budgets, "auto" threads, the C attention kernel), in this
process. Reported per page size: the median generation wall time of the repeats, generated tokens/s, the ratio of
that time to the first page size's, and whether the outputs equal the first page size's token for token. This is
the measurement behind ``cbrun.engine.config.DEFAULT_PAGE_SIZE["cpu"]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cbrun.bench.workloads import build_workload
from cbrun.engine import EngineConfig, LLMEngine, SamplingParams


def run_once(workload, page_size: int) -> tuple[float, list[list[int]]]:
    """(generation wall seconds, output token ids in row order) of one run at ``page_size``."""
    engine = LLMEngine.from_pretrained(str(workload.model_dir), EngineConfig(page_size=page_size))
    requests = [
        (i, prompt, SamplingParams(max_new_tokens=m, stop_token_ids=workload.stop_token_ids))
        for i, (prompt, m) in enumerate(zip(workload.prompts, workload.max_new_tokens))
    ]
    start = time.perf_counter()
    outputs = {o.request_id: o.output_token_ids for o in engine.generate(requests, max_in_flight=len(requests))}
    wall = time.perf_counter() - start
    return wall, [outputs[i] for i in range(len(requests))]


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="gsm8k-long")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--page-sizes", default="16,32,64,128")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-dir", type=Path, default=Path("models/stories260K"))
    p.add_argument("--markdown", type=Path)
    args = p.parse_args()
    sizes = [int(s) for s in args.page_sizes.split(",")]
    load_start = os.getloadavg()
    walls: dict[int, list[float]] = {s: [] for s in sizes}
    outputs: dict[int, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        workload = build_workload(args.workload, args.rows, (16, 256), 0, args.model_dir, Path(scratch))
        for repeat in range(args.repeats):
            for size in sizes:
                wall, tokens = run_once(workload, size)
                walls[size].append(wall)
                outputs.setdefault(size, tokens)
                print(f"[page_size] repeat {repeat + 1}/{args.repeats} page_size {size}: {wall:.2f} s", file=sys.stderr)
    num_tokens = sum(len(t) for t in outputs[sizes[0]])
    base = statistics.median(walls[sizes[0]])
    lines = [
        f"generation phase of `LLMEngine.generate` on {args.workload} ({args.rows} rows, {num_tokens} generated "
        f"tokens), engine defaults but `page_size`; median of {args.repeats} round-robin repeats",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; load average (1 min) at "
        f"start {load_start[0]:.2f}, end {os.getloadavg()[0]:.2f}",
        f"command: python -m benchmarks.page_size --workload {args.workload} --rows {args.rows} "
        f"--page-sizes {args.page_sizes} --repeats {args.repeats}",
        "",
        "| page_size | generation s (median) | min-max s | generated tok/s | time vs page_size "
        f"{sizes[0]} | outputs == page_size {sizes[0]} |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for size in sizes:
        median = statistics.median(walls[size])
        same = sum(a == b for a, b in zip(outputs[size], outputs[sizes[0]]))
        lines.append(
            f"| {size} | {median:.2f} | {min(walls[size]):.2f}-{max(walls[size]):.2f} | "
            f"{num_tokens / median:.0f} | {median / base:.2f}x | {same}/{len(outputs[size])} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.markdown:
        args.markdown.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
