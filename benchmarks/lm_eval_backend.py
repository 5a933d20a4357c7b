"""lm-eval end to end: ``--model hf`` against ``--model cbrun`` on the local GSM8K tasks, through one CLI.

Usage (from the repo root, with the eval extra installed and stories260K converted to ``models/stories260K``)::

    python benchmarks/lm_eval_backend.py [--repeats 3] [--startup-repeats 1] [--mc-limit N] [--gen-limit 20]
        [--gen-large-limit 400] [--out benchmarks/results-lm-eval.md]

Each run is a fresh process of lm-eval's own CLI, one CPU thread (``OMP_NUM_THREADS=1``, no tokenizer threads;
cbrun also gets ``num_threads=1``), tasks from ``tests/evals/tasks`` (``--include_path``), nothing from a hub
(``HF_DATASETS_OFFLINE=1``). Backends:

- ``hf``: ``cbrun lm-eval --model hf``, lm-eval's ``hf`` backend with its defaults (``batch_size=1``, float32 on
  the CPU) through the same CLI as cbrun: lm-eval's CLI with its task index cached (``cbrun.jobs.integrations.lm_eval_task_index``);
- ``cbrun``: ``cbrun lm-eval --model cbrun`` with the backend's defaults;
- ``hf (plain lm_eval)``: ``lm_eval --model hf``, lm-eval's own CLI as installed (every run indexes its ~14k
  built-in task configs), on the startup and multiple-choice rows only: what ``cbrun lm-eval`` saves any backend.

Backends alternate within each repeat (hf first in odd repeats, cbrun first in even ones). Before the first repeat
one untimed run warms the index cache, and one run with an empty cache directory times a first run ever (index
built and written).

Rows per task:

- ``startup``: the multiple-choice task with ``--limit 1``: lm-eval's fixed cost (imports, task index, model load),
  paid by every run of either backend;
- ``cbrun_gsm8k_mc``: multiple choice, every row of ``gsm8k_mc.parquet`` (4 loglikelihood requests a row);
- ``cbrun_gsm8k_gen``: generate_until, greedy, ``max_gen_toks`` 128, ``--gen-limit`` rows (mostly fixed cost), and
  again ``--gen-large-limit`` rows (0 skips it).

Columns: wall seconds per repeat and their median, CPU seconds (user + system of the process, median), the
task's metrics (equal between backends or the script says so), cbrun's prefix-cache hit rate (its log line), and
hf's median over cbrun's median (speedup) of wall and CPU seconds, end to end and minus the startup row's
median (the work of the task itself), and plain ``lm_eval``'s hf over cbrun where measured. On a machine shared
with other work, CPU seconds are the steadier measure.
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

TITLE = (
    "# lm-eval: `--model hf` against `--model cbrun`\n\n`python benchmarks/lm_eval_backend.py` (its docstring "
    "defines every row and column). The stories260K model, the local GSM8K tasks of `tests/evals/tasks/`, "
    "lm-eval's own CLI (both backends through `cbrun lm-eval`; plain `lm_eval` for reference), one thread "
    "each, `hf` with its defaults (batch size 1). Target: cbrun at least 3x faster than `hf` end to end "
    "(wall), equal metrics.\n\n"
)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIT_RATE_RE = re.compile(r"hit rate ([0-9.]+)%")
HF, CBRUN, PLAIN_HF = "hf", "cbrun", "hf (plain lm_eval)"
#: Rows that also run plain ``lm_eval --model hf``.
PLAIN_HF_ROWS = ("startup", "cbrun_gsm8k_mc")


def command(backend: str, model: str, task: str, limit: int | None, output_dir: str) -> list[str]:
    """The argv of one lm-eval run: ``backend`` (``HF``, ``CBRUN`` or ``PLAIN_HF``) on ``task``, ``limit`` rows
    (``None``: all), results under ``output_dir``."""
    if backend == PLAIN_HF:
        head = [
            sys.executable,
            "-m",
            "lm_eval",
            "run",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={model},dtype=float32",
        ]
    elif backend == HF:
        head = [
            sys.executable,
            "-m",
            "cbrun.jobs.cli",
            "lm-eval",
            "run",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={model},dtype=float32",
        ]
    else:
        head = [
            sys.executable,
            "-m",
            "cbrun.jobs.cli",
            "lm-eval",
            "run",
            "--model",
            "cbrun",
            "--model_args",
            f"pretrained={model},num_threads=1",
        ]
    tail = ["--device", "cpu", "--include_path", "tests/evals/tasks", "--tasks", task, "--output_path", output_dir]
    return head + tail + (["--limit", str(limit)] if limit else [])


def run_once(backend: str, model: str, task: str, limit: int | None, extra_env: dict | None = None) -> dict:
    """One lm-eval process: wall and CPU seconds, the task's metrics, cbrun's hit rate, the 1-minute load average
    at its start."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **(extra_env or {}),
    }
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as output_dir:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(
            command(backend, model, task, limit, output_dir), cwd=REPO_ROOT, env=env, capture_output=True, text=True
        )
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"{backend} on {task} failed:\n{proc.stderr[-3000:]}")
        results = json.load(open(sorted(glob.glob(f"{output_dir}/**/results_*.json", recursive=True))[-1]))
    metrics = {
        k: v
        for k, v in results["results"][task].items()
        if "," in k and "stderr" not in k and isinstance(v, (int, float))
    }
    hit = HIT_RATE_RE.findall(proc.stderr)
    return {
        "wall": wall,
        "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "metrics": metrics,
        "hit_rate": float(hit[-1]) if hit else None,
        "load": load,
    }


def cold_start(model: str) -> dict:
    """The startup row of cbrun with an empty cache directory: a first run ever builds and writes the index."""
    with tempfile.TemporaryDirectory() as cache:
        return run_once(CBRUN, model, "cbrun_gsm8k_mc", 1, {"CBRUN_CACHE_DIR": cache})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/stories260K")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--startup-repeats", type=int, default=1)
    parser.add_argument("--mc-limit", type=int, default=None, help="rows of the multiple-choice task (default all)")
    parser.add_argument("--gen-limit", type=int, default=20)
    parser.add_argument("--gen-large-limit", type=int, default=400, help="a second generate_until row (0: none)")
    parser.add_argument("--out", default="benchmarks/results-lm-eval.md", help="the results file ('' for none)")
    args = parser.parse_args(argv)
    runs = [
        ("startup", "cbrun_gsm8k_mc", 1),
        ("cbrun_gsm8k_mc", "cbrun_gsm8k_mc", args.mc_limit),
        (f"cbrun_gsm8k_gen {args.gen_limit}", "cbrun_gsm8k_gen", args.gen_limit),
    ]
    if args.gen_large_limit:
        runs.append((f"cbrun_gsm8k_gen {args.gen_large_limit}", "cbrun_gsm8k_gen", args.gen_large_limit))
    run_once(CBRUN, args.model, "cbrun_gsm8k_mc", 1)  # warms the task index cache; not timed
    cold = cold_start(args.model)
    print(f"cold start: {cold['wall']:.1f} s wall, {cold['cpu']:.1f} s CPU", file=sys.stderr, flush=True)
    results: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        order = (HF, CBRUN, PLAIN_HF) if repeat % 2 == 0 else (CBRUN, HF, PLAIN_HF)
        for name, task, limit in runs:
            if name == "startup" and repeat >= args.startup_repeats:
                continue
            for backend in order:
                if backend == PLAIN_HF and name not in PLAIN_HF_ROWS:
                    continue
                result = run_once(backend, args.model, task, limit)
                results.setdefault((name, backend), []).append(result)
                print(
                    f"repeat {repeat + 1} {name} {backend}: {result['wall']:.1f} s wall, {result['cpu']:.1f} s CPU, "
                    f"{result['metrics']}, hit rate {result['hit_rate']}, load {result['load']:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
    table = render(results, runs, args, cold)
    print(table)
    if args.out:
        with open(os.path.join(REPO_ROOT, args.out), "w") as f:
            f.write(TITLE + table)
    return 0


def render(results, runs, args, cold: dict) -> str:
    """The results file's text: header (machine, load, command, first-run cost) and the table.

    Args:
        results: ``(row name, backend)`` to each repeat's ``run_once`` result.
        runs: ``(row name, task, limit)`` in table order; ``startup`` first.
        args: the parsed command line (repeats and limits, echoed as the command).
        cold: ``cold_start``'s result.
    """

    def median(name, backend, key="wall"):
        return statistics.median(r[key] for r in results[(name, backend)])

    def ratio(hf: float, cbrun: float) -> str:
        return f"{hf / cbrun:.1f}x" if cbrun > 0 else "n/a"

    def minus_startup(name, backend, key):
        return median(name, backend, key) - median("startup", backend, key)

    lines = [
        "| task | rows | backend | wall s (each repeat) | median wall s | median CPU s | metrics | prefix hit rate "
        "| hf / cbrun wall | hf / cbrun CPU | hf / cbrun wall minus startup | hf / cbrun CPU minus startup "
        "| plain lm_eval hf / cbrun wall |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, _, limit in runs:
        backends = [b for b in (HF, CBRUN, PLAIN_HF) if (name, b) in results]
        reference = results[(name, HF)][0]["metrics"]
        equal = all(r["metrics"] == reference for b in backends for r in results[(name, b)])
        for backend in backends:
            rs = results[(name, backend)]
            hit = rs[-1]["hit_rate"]
            ratios = [""] * 5
            if backend == CBRUN:
                ratios[:2] = [ratio(median(name, HF, key), median(name, CBRUN, key)) for key in ("wall", "cpu")]
                if name != "startup":
                    ratios[2:4] = [
                        ratio(minus_startup(name, HF, key), minus_startup(name, CBRUN, key)) for key in ("wall", "cpu")
                    ]
                if (name, PLAIN_HF) in results:
                    ratios[4] = ratio(median(name, PLAIN_HF), median(name, CBRUN))
            shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in rs[0]["metrics"].items())
            walls = ", ".join(f"{r['wall']:.1f}" for r in rs)
            lines.append(
                f"| {name.split(' ')[0]} | {limit or 'all'} | {backend} | {walls} | "
                f"{median(name, backend):.1f} | {median(name, backend, 'cpu'):.1f} | "
                f"{shown}{'' if equal else ' (DIFFER)'} | {'' if hit is None else f'{hit:.1f}%'} | "
                f"{' | '.join(ratios)} |"
            )
    load = os.getloadavg()
    loads = [r["load"] for rs in results.values() for r in rs]
    header = (
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()} "
        f"({os.cpu_count()} CPUs, {platform.processor() or platform.machine()}), model {args.model}, "
        f"{args.repeats} interleaved repeats ({args.startup_repeats} of the startup row), one thread each; "
        f"1-minute load average at the runs' starts {min(loads):.1f} to {max(loads):.1f}, at the end "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min).\n"
        f"Command: `python benchmarks/lm_eval_backend.py --repeats {args.repeats} --startup-repeats "
        f"{args.startup_repeats}{f' --mc-limit {args.mc_limit}' if args.mc_limit else ''} "
        f"--gen-limit {args.gen_limit} --gen-large-limit {args.gen_large_limit}`\n\n"
        f"A first run ever (cbrun, startup row, empty index cache: lm-eval's index built and written): "
        f"{cold['wall']:.1f} s wall, {cold['cpu']:.1f} s CPU.\n\n"
    )
    return header + "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
