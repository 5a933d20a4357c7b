"""lm-eval end to end: ``lm_eval --model hf`` against ``cbrun lm-eval --model cbrun`` on the local GSM8K tasks.

Usage (from the repo root, with the eval extra installed and stories260K converted to ``models/stories260K``)::

    python benchmarks/lm_eval_backend.py [--repeats 3] [--startup-repeats 1] [--mc-limit N] [--gen-limit 20]
        [--out benchmarks/results-lm-eval.md]

Each run is a fresh process of lm-eval's own CLI, one CPU thread (``OMP_NUM_THREADS=1``; cbrun also gets
``num_threads=1``), tasks from ``tests/evals/tasks`` (``--include_path``), nothing from a hub
(``HF_DATASETS_OFFLINE=1``). ``hf`` runs with its defaults (``batch_size=1``, float32 on the CPU); cbrun with its
backend defaults. Backends alternate within each repeat (hf first in odd repeats, cbrun first in even ones).

Rows per task:

- ``startup``: the multiple-choice task with ``--limit 1``: lm-eval's fixed cost (imports, indexing its ~10k
  built-in task configs, model load), paid by every run of either backend;
- ``cbrun_gsm8k_mc``: multiple choice, every row of ``gsm8k_mc.parquet`` (4 loglikelihood requests a row);
- ``cbrun_gsm8k_gen``: generate_until, greedy, ``max_gen_toks`` 128, ``--gen-limit`` rows.

Columns: wall seconds per repeat and their median, CPU seconds (user + system of the process, median), the
task's metrics (equal between backends or the script says so), cbrun's prefix-cache hit rate (its log line), and
hf's median over cbrun's median (speedup) of wall and CPU seconds, end to end and minus the startup row's
median (the work of the task itself). On a machine shared with other work, CPU seconds are the steadier measure.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

TITLE = ("# lm-eval: `--model hf` against `--model cbrun`\n\n`python benchmarks/lm_eval_backend.py` (its docstring "
         "defines every row and column). The stories260K model, the local GSM8K tasks of `tests/evals/tasks/`, "
         "lm-eval's own CLI, one thread each, `hf` with its defaults (batch size 1). Target: cbrun at least 3x "
         "faster than `hf` end to end (wall), equal metrics.\n\n")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIT_RATE_RE = re.compile(r"hit rate ([0-9.]+)%")


def command(backend: str, model: str, task: str, limit: int | None, output_dir: str) -> list[str]:
    if backend == "hf":
        head = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                f"pretrained={model},dtype=float32"]
    else:
        head = [sys.executable, "-m", "jobs.cli", "lm-eval", "run", "--model", "cbrun", "--model_args",
                f"pretrained={model},num_threads=1"]
    tail = ["--device", "cpu", "--include_path", "tests/evals/tasks", "--tasks", task, "--output_path", output_dir]
    return head + tail + (["--limit", str(limit)] if limit else [])


def run_once(backend: str, model: str, task: str, limit: int | None) -> dict:
    """One lm-eval process: wall and CPU seconds, the task's metrics, cbrun's hit rate."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as output_dir:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(command(backend, model, task, limit, output_dir), cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"{backend} on {task} failed:\n{proc.stderr[-3000:]}")
        results = json.load(open(sorted(glob.glob(f"{output_dir}/**/results_*.json", recursive=True))[-1]))
    metrics = {k: v for k, v in results["results"][task].items()
               if "," in k and "stderr" not in k and isinstance(v, (int, float))}
    hit = HIT_RATE_RE.findall(proc.stderr)
    return {"wall": wall, "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "metrics": metrics, "hit_rate": float(hit[-1]) if hit else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/stories260K")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--startup-repeats", type=int, default=1)
    parser.add_argument("--mc-limit", type=int, default=None, help="rows of the multiple-choice task (default all)")
    parser.add_argument("--gen-limit", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results-lm-eval.md", help="the results file ('' for none)")
    args = parser.parse_args(argv)
    runs = [("startup", "cbrun_gsm8k_mc", 1), ("cbrun_gsm8k_mc", "cbrun_gsm8k_mc", args.mc_limit),
            ("cbrun_gsm8k_gen", "cbrun_gsm8k_gen", args.gen_limit)]
    results: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        order = ("hf", "cbrun") if repeat % 2 == 0 else ("cbrun", "hf")
        for name, task, limit in runs:
            if name == "startup" and repeat >= args.startup_repeats:
                continue
            for backend in order:
                result = run_once(backend, args.model, task, limit)
                results.setdefault((name, backend), []).append(result)
                print(f"repeat {repeat + 1} {name} {backend}: {result['wall']:.1f} s wall, {result['cpu']:.1f} s CPU, "
                      f"{result['metrics']}, hit rate {result['hit_rate']}", file=sys.stderr, flush=True)
    table = render(results, runs, args)
    print(table)
    if args.out:
        with open(os.path.join(REPO_ROOT, args.out), "w") as f:
            f.write(TITLE + table)
    return 0


def render(results, runs, args) -> str:
    def median(name, backend, key="wall"):
        return statistics.median(r[key] for r in results[(name, backend)])

    def ratio(hf: float, cbrun: float) -> str:
        return f"{hf / cbrun:.1f}x" if cbrun > 0 else "n/a"

    lines = [
        "| task | rows | backend | wall s (each repeat) | median wall s | median CPU s | metrics | prefix hit rate "
        "| hf / cbrun wall | hf / cbrun CPU | hf / cbrun wall minus startup | hf / cbrun CPU minus startup |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, _, limit in runs:
        reference = results[(name, "hf")][0]["metrics"]
        equal = all(r["metrics"] == reference for b in ("hf", "cbrun") for r in results[(name, b)])
        for backend in ("hf", "cbrun"):
            rs = results[(name, backend)]
            hit = rs[-1]["hit_rate"]
            ratios = ["", "", "", ""]
            if backend == "cbrun":
                ratios = [ratio(median(name, "hf", key), median(name, "cbrun", key)) for key in ("wall", "cpu")]
                if name != "startup":
                    ratios += [ratio(median(name, "hf", key) - median("startup", "hf", key),
                                     median(name, "cbrun", key) - median("startup", "cbrun", key))
                               for key in ("wall", "cpu")]
                else:
                    ratios += ["", ""]
            shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in rs[0]["metrics"].items())
            walls = ", ".join(f"{r['wall']:.1f}" for r in rs)
            lines.append(f"| {name} | {limit or 'all'} | {backend} | {walls} | {median(name, backend):.1f} | "
                         f"{median(name, backend, 'cpu'):.1f} | {shown}{'' if equal else ' (DIFFER)'} | "
                         f"{'' if hit is None else f'{hit:.1f}%'} | {' | '.join(ratios)} |")
    header = (f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()} "
              f"({os.cpu_count()} CPUs, {platform.processor() or platform.machine()}), model {args.model}, "
              f"{args.repeats} interleaved repeats ({args.startup_repeats} of the startup row), one thread each.\n"
              f"Command: `python benchmarks/lm_eval_backend.py --repeats {args.repeats} --startup-repeats "
              f"{args.startup_repeats}{f' --mc-limit {args.mc_limit}' if args.mc_limit else ''} "
              f"--gen-limit {args.gen_limit}`\n\n")
    return header + "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
