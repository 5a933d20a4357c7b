"""Scale-out on one machine: 1 process against 2 concurrent shards, Ray with 1 against 2 replicas, Ray's overhead.

Usage (from the repository root; stories260K from ../shared/models/stories260K is converted into a temp folder):

    PYTHONPATH=. python benchmarks/scale_out.py --repeats 3

Every configuration runs the same greedy job as whole ``cbrun run`` commands (process start, model load and Ray
start included) with one torch thread per engine (``OMP_NUM_THREADS=1``, ``engine.num_threads = 1``; Ray replicas:
``num_cpus_per_replica = 1``), ``SLOTS`` engine slots and Ray batches of ``SLOTS`` rows. "1 batch at a time" sets
``cluster.max_concurrent_batches = 1``, so a replica's engine drains at the end of each batch. Configurations are interleaved round-robin, rotating their order each repeat. Besides the full job, the
single process and Ray with 1 replica also run the first ``--small-rows`` rows: the difference of the two sizes
removes each executor's fixed start-up cost, so Ray's overhead splits into a fixed part and a per-row part. Every
output must equal the single process's, token for token. Writes ``--output`` (a Markdown table) and prints it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"
NAMES = [
    "1 process",
    "2 shards",
    "ray 1 replica",
    "ray 2 replicas",
    "ray 1 replica, 1 batch at a time",
    "1 process (small)",
    "ray 1 replica (small)",
]
#: Engine slots (``engine.max_requests_per_batch``) and Ray batch rows: a replica holding 2 batches fills its engine
#: as the single process does, so the comparison is of the executors, not of how full the engine is.
SLOTS = 16


def job_args(model: Path, data: Path, max_new_tokens: int) -> list[str]:
    # NOTE: no ignore_eos: rows end at different lengths, as real ones do, so a batch has a tail for the next
    # batch's rows to fill (what cluster.max_concurrent_batches is for).
    return [
        sys.executable,
        "-m",
        "cbrun.jobs.cli",
        "run",
        "--model",
        str(model),
        "--input",
        str(data),
        "--prompt-column",
        "prompt",
        "--max-new-tokens",
        str(max_new_tokens),
        "--temperature",
        "0",
        "--no-progress",
        "--set",
        "engine.device=cpu",
        "--set",
        "engine.num_threads=1",
        "--set",
        f"engine.max_requests_per_batch={SLOTS}",
        "--set",
        f"cluster.batch_size={SLOTS}",
        "--set",
        "cluster.num_cpus_per_replica=1",
    ]


def commands(name: str, base: list[str], small_rows: int) -> list[list[str]]:
    small = ["--set", f"input.limit={small_rows}"]
    ray = ["--executor", "ray"]
    return {
        "1 process": [base],
        "2 shards": [base + ["--shard", "0/2"], base + ["--shard", "1/2"]],
        "ray 1 replica": [base + ray + ["--set", "cluster.num_replicas=1"]],
        "ray 2 replicas": [base + ray + ["--set", "cluster.num_replicas=2"]],
        "ray 1 replica, 1 batch at a time": [
            base + ray + ["--set", "cluster.num_replicas=1", "--set", "cluster.max_concurrent_batches=1"]
        ],
        "1 process (small)": [base + small],
        "ray 1 replica (small)": [base + ray + small + ["--set", "cluster.num_replicas=1"]],
    }[name]


def run_config(name: str, base: list[str], out: Path, small_rows: int) -> float:
    """Wall seconds of one configuration (all its processes, started together)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    processes = [
        subprocess.Popen(
            c + ["--output", str(out)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for c in commands(name, base, small_rows)
    ]
    for process in processes:
        _, stderr = process.communicate()
        assert process.returncode == 0, f"{name}: {stderr[-2000:]}"
    return time.perf_counter() - start


def outputs(out: Path) -> list:
    table = pq.read_table(out, columns=["row_index", "completion_token_ids"]).sort_by("row_index")
    return table.column("completion_token_ids").to_pylist()


def report(args, times: dict[str, list[float]]) -> str:
    median = {name: statistics.median(runs) for name, runs in times.items()}
    single = median["1 process"]
    lines = [
        "# Scale-out on one machine: shards and Ray replicas",
        "",
        (
            f"`PYTHONPATH=. python benchmarks/scale_out.py --rows {args.rows} --small-rows {args.small_rows} "
            f"--max-new-tokens {args.max_new_tokens} --repeats {args.repeats}`: stories260K, greedy, one torch thread "
            f"per engine, `engine.max_requests_per_batch = {SLOTS}`, Ray batches of {SLOTS} rows and the default "
            f"`cluster.max_concurrent_batches` (2) unless named; rows end at EOS or the token limit; each "
            f"configuration a whole `cbrun run` (process start, model load and, for Ray, starting a local Ray instance "
            f"and its actors included); configurations interleaved round-robin, order rotated each repeat; "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average at the end "
            f"{os.getloadavg()[0]:.1f}. Every configuration's outputs equal the single process's, token for token."
        ),
        "",
        "| configuration | rows | wall s (median) | all runs s | rows/s | vs 1 process |",
        "|---|---|---|---|---|---|",
    ]
    for name in NAMES:
        rows = args.small_rows if "small" in name else args.rows
        runs = ", ".join(f"{t:.1f}" for t in times[name])
        ratio = f"{single / median[name]:.2f}x" if "small" not in name else "-"  # small: other rows
        lines.append(f"| {name} | {rows} | {median[name]:.1f} | {runs} | {rows / median[name]:.1f} | {ratio} |")
    extra_rows = args.rows - args.small_rows
    per_row_single = (single - median["1 process (small)"]) / extra_rows
    per_row_ray = (median["ray 1 replica"] - median["ray 1 replica (small)"]) / extra_rows
    fixed = (median["ray 1 replica (small)"] - median["1 process (small)"]) - args.small_rows * (
        per_row_ray - per_row_single
    )
    lines += [
        "",
        (
            f"- 2 replicas against 1 (the same Ray job): {median['ray 1 replica'] / median['ray 2 replicas']:.2f}x; "
            f"2 concurrent shards against 1 process: {single / median['2 shards']:.2f}x; a replica holding 2 batches "
            f"against 1 at a time: {median['ray 1 replica, 1 batch at a time'] / median['ray 1 replica']:.2f}x."
        ),
        (
            f"- Per row (the {args.rows}-row job minus the {args.small_rows}-row job, so start-up cancels): 1 process "
            f"{1000 * per_row_single:.1f} ms, Ray 1 replica {1000 * per_row_ray:.1f} ms: Ray adds "
            f"{1000 * (per_row_ray - per_row_single):.1f} ms per row."
        ),
        (
            f"- Ray's fixed cost (local instance, actor start, engine load in the actor, driver set-up) beyond the "
            f"single process's start-up: {fixed:.1f} s per run; `--ray-address auto` on a running cluster skips the "
            "instance start."
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--small-rows", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results-scale-out.md")
    args = parser.parse_args()
    assert 0 < args.small_rows < args.rows and args.rows >= 16, "need 0 < --small-rows < --rows, --rows >= 16"
    sys.path.insert(0, str(REPO))
    from cbrun.jobs.model.convert_llama2c import convert_llama2c

    work = Path(tempfile.mkdtemp(prefix="cbrun-scale-"))
    model = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", work / "model")
    data = work / "in.parquet"
    pq.write_table(
        pa.table(
            {"prompt": [f"Once upon a time, {('Lily', 'Tom', 'Sue')[i % 3]} found {i} " for i in range(args.rows)]}
        ),
        data,
        row_group_size=32,
    )
    base = job_args(model, data, args.max_new_tokens)
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    got: dict[str, list] = {}
    for repeat in range(args.repeats):
        for k in range(len(NAMES)):
            name = NAMES[(k + repeat) % len(NAMES)]
            out = work / f"out-{repeat}-{k}"
            times[name].append(run_config(name, base, out, args.small_rows))
            got[f"{name} #{repeat}"] = outputs(out)
            print(f"repeat {repeat} {name}: {times[name][-1]:.1f} s", file=sys.stderr)
    reference = got["1 process #0"]
    for key, tokens in got.items():
        assert tokens == reference[: len(tokens)] and len(tokens) in (args.rows, args.small_rows), (
            f"{key}: outputs differ from the single process's"
        )
    text = report(args, times)
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
