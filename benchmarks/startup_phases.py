"""Where the whole ``cbrun run`` command's time goes outside generation: wall and CPU seconds per phase, from
process start to exit, for one or more checkouts side by side.

Usage (from the repository root)::

    python -m benchmarks.startup_phases --tree before=/path/to/old/checkout --tree after=. --repeats 3 \\
        --markdown benchmarks/results-startup-phases.md

The workload is ``cbrun bench``'s gsm8k-long (stories260K on the first ``--rows`` GSM8K test questions as prompt
ids, greedy, stop token 1, ``--max-new-tokens 256``) and the command is the bench's ``cbrun-command`` one: default
settings, a fresh process. Each run starts this file as a script with ``PYTHONPATH`` set to the tree, so the tree's
own ``cbrun.jobs.cli`` runs (its exit included); the script wraps the job's steps (``cbrun.jobs.run.job``'s setup functions, the
row loop, the writer's commits) with clocks, and counts the garbage collector's time (``gc.callbacks``) before and
during generation. The parent times the process from spawn to exit. Trees run round-robin; each cell is the median
over the repeats.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: (phase, the mark it starts at (None: process spawn), the mark it ends at).
PHASES = (
    ("interpreter start, import jobs.cli", None, "cli imported"),
    (
        "import jobs.run.job (numpy, pyarrow), the CLI's logging setup (it imported transformers before the safetensors "
        "loader)",
        "cli imported",
        "_quiet_transformers",
    ),
    ("open the input", "_quiet_transformers", "open_reader"),
    (
        "check the model directory (before the safetensors loader: imports torch and transformers' AutoConfig)",
        "open_reader",
        "check_model_dir",
    ),
    (
        "device (imports torch, unless imported already), tokenizer, fingerprint, output directory check",
        "check_model_dir",
        "_Job.open",
    ),
    (
        "load the engine (model, tokenizer, KV cache; transformers' modeling imports where used)",
        "_Job.open",
        "load_engine",
    ),
    ("start the writer", "load_engine", "start_writer"),
    ("generation phase (read rows, generate, final commit)", "start_writer", "_JobRun.run"),
    ("finish (stats.json, _SUCCESS), summary line", "_JobRun.run", "main done"),
    ("exit (atexit handlers, interpreter teardown)", "main done", "exit"),
)


def child() -> None:
    """Run ``cbrun.jobs.cli.main()`` on this process's arguments with the job's steps clocked; marks go to $MARKS_OUT."""
    import atexit
    import functools
    import gc

    base = float(os.environ["SPAWN_T"])
    marks: dict[str, tuple[float, float]] = {}
    gc_s = {"setup": 0.0, "generation": 0.0, "finish": 0.0}
    state = {"phase": "setup", "t": 0.0}

    def mark(name: str) -> None:
        marks.setdefault(name, (time.time() - base, time.process_time()))

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            state["t"] = time.perf_counter()
        else:
            gc_s[state["phase"]] += time.perf_counter() - state["t"]

    def clocked(owner, name: str, label: str | None = None, *, generation: bool = False) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if generation:
                state["phase"] = "generation"
            try:
                return fn(*args, **kwargs)
            finally:
                mark(label or name)
                if generation:
                    state["phase"] = "finish"

        setattr(owner, name, wrapper)

    gc.callbacks.append(on_gc)
    from cbrun.jobs.cli import commands as cli

    mark("cli imported")
    clocked(cli, "_quiet_transformers")
    # NOTE: jobs.run.job imported here rather than by the CLI: its import (numpy, pyarrow) lands in the next phase.
    from cbrun.jobs.run import job

    try:
        from cbrun.jobs.run import locked_run, row_loop
    except ImportError:  # NOTE: a tree from before the run under the lock and the row loop left jobs.run.job
        locked_run = row_loop = job

    for name in ("open_reader", "check_model_dir"):
        clocked(job, name)
    clocked(locked_run, "load_engine")
    clocked(locked_run._Job, "open", "_Job.open")
    clocked(locked_run._Job, "start_writer")
    clocked(row_loop._JobRun, "run", "_JobRun.run", generation=True)

    def report() -> None:
        mark("main done")
        Path(os.environ["MARKS_OUT"]).write_text(
            json.dumps({"marks": marks, "gc_s": gc_s, "transformers": "transformers" in sys.modules})
        )

    atexit.register(report)
    sys.exit(cli.main())


def prepare(scratch: Path, rows: int) -> tuple[Path, Path]:
    """(stories260K converted, a Parquet file of gsm8k-long's prompt ids) in ``scratch``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cbrun.bench.workloads import build_workload

    workload = build_workload("gsm8k-long", rows, (16, 256), 0, None, scratch)
    prompts = scratch / "prompts.parquet"
    pq.write_table(pa.table({"prompt_token_ids": pa.array(workload.prompts, pa.list_(pa.int32()))}), prompts)
    return workload.model_dir, prompts


def run_once(tree: Path, model_dir: Path, prompts: Path, scratch: Path) -> dict:
    """One traced whole command in ``tree``: per-phase (wall s, CPU s), the GC's seconds, the stats."""
    out, marks_path = scratch / "out", scratch / "marks.json"
    shutil.rmtree(out, ignore_errors=True)
    args = [
        "run",
        "--model",
        str(model_dir),
        "--input",
        str(prompts),
        "--prompt-ids-column",
        "prompt_token_ids",
        "--output",
        str(out),
        "--max-new-tokens",
        "256",
        "--no-progress",
        "--set",
        "sampling.stop_token_ids=[1]",
    ]
    spawn = time.time()
    env = {**os.environ, "PYTHONPATH": str(tree), "MARKS_OUT": str(marks_path), "SPAWN_T": repr(spawn)}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", *args],
        check=False,
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.time() - spawn
    if done.returncode != 0:
        raise RuntimeError(f"cbrun run in {tree} exited {done.returncode}: {done.stderr[-3000:]}")
    traced = json.loads(marks_path.read_text())
    marks = {**traced["marks"], "exit": (wall, None)}
    phases = {}
    for phase, start, end in PHASES:
        (t0, c0), (t1, c1) = marks[start] if start else (0.0, 0.0), marks[end]
        phases[phase] = (t1 - t0, None if c1 is None or c0 is None else c1 - c0)
    stats = json.loads((out / "_cbrun" / "stats.json").read_text())
    return {
        "phases": phases,
        "wall_s": wall,
        "gc_s": traced["gc_s"],
        "generation_s": stats["generation_s"],
        "transformers": traced.get("transformers"),
        "peak_memory_mib": stats["peak_memory_mib"],
        "summary": done.stdout.strip().splitlines()[-1],
    }


def format_table(results: dict[str, list[dict]]) -> str:
    trees = list(results)

    def med(values) -> str:
        values = [v for v in values if v is not None]
        return f"{statistics.median(values):.2f}" if values else "n/a"

    head = "| phase | " + " | ".join(f"{t} wall s | {t} CPU s" for t in trees) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(trees)]
    for phase, _, _ in PHASES:
        cells = [
            c
            for t in trees
            for c in (med(r["phases"][phase][0] for r in results[t]), med(r["phases"][phase][1] for r in results[t]))
        ]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    rows = (
        ("**whole command**", lambda r: r["wall_s"], None),
        ("of which outside the generation phase", lambda r: r["wall_s"] - r["generation_s"], None),
        ("garbage collector, before generation", lambda r: r["gc_s"]["setup"], None),
        ("garbage collector, during generation", lambda r: r["gc_s"]["generation"], None),
        ("peak RSS MiB (the summary line's peak memory)", lambda r: r["peak_memory_mib"], None),
    )
    for name, value, _ in rows:
        lines.append(
            f"| {name} | " + " | ".join(c for t in trees for c in (med(value(r) for r in results[t]), "")) + " |"
        )
    imported = [", ".join(sorted({"yes" if r["transformers"] else "no" for r in results[t]})) for t in trees]
    lines.append("| transformers imported | " + " | ".join(c for i in imported for c in (i, "")) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tree",
        action="append",
        required=True,
        metavar="LABEL=PATH",
        help="a checkout to run (repeatable), e.g. before=/tmp/old after=.",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--markdown", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    trees = {label: Path(path).resolve() for label, path in (t.split("=", 1) for t in args.tree)}
    with tempfile.TemporaryDirectory(prefix="cbrun-startup-") as tmp:
        scratch = Path(tmp)
        model_dir, prompts = prepare(scratch, args.rows)
        load_start = os.getloadavg()
        results: dict[str, list[dict]] = {label: [] for label in trees}
        for repeat in range(args.repeats):
            for label, tree in trees.items():
                result = run_once(tree, model_dir, prompts, scratch)
                results[label].append(result)
                print(
                    f"repeat {repeat + 1} {label}: {result['wall_s']:.2f} s whole, {result['generation_s']:.2f} s "
                    f"generation",
                    file=sys.stderr,
                )
    report = "\n".join(
        [
            (
                f"whole `cbrun run` command on gsm8k-long ({args.rows} rows, stories260K, default settings), per phase; "
                f"median of {args.repeats} round-robin repeats; trees: "
                + ", ".join(f"{label} = {tree}" for label, tree in trees.items())
            ),
            (
                f"machine: {os.cpu_count()} CPUs, {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; "
                f"load average (1 min) at start {load_start[0]:.2f}, end {os.getloadavg()[0]:.2f}"
            ),
            f"command: python -m benchmarks.startup_phases {' '.join(argv if argv is not None else sys.argv[1:])}",
            "",
            format_table(results),
        ]
    )
    print(report)
    if args.markdown:
        args.markdown.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.argv = [sys.argv[0], *sys.argv[2:]]
        child()
    else:
        sys.exit(main())
