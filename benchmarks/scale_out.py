"""Scale-out on one machine: one process against 2 concurrent shards, and Ray with 1 against 2 replicas.

Usage (from the repository root; stories260K from ../shared/models/stories260K is converted into a temp folder):

    python benchmarks/scale_out.py --rows 256 --max-new-tokens 32 --repeats 2

Every configuration runs the same greedy job as whole ``cbrun run`` commands (process start, model load and Ray
start included) with one torch thread per engine (``OMP_NUM_THREADS=1``; Ray replicas: ``num_cpus_per_replica =
1``). Configurations are interleaved, rotating their order each repeat; the table gives each one's median wall
seconds, rows/s and its ratio to the single process, and checks that every output equals the single process's.
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


def job_args(model: Path, data: Path, out: Path, max_new_tokens: int) -> list[str]:
    return [sys.executable, "-m", "jobs.cli", "run", "--model", str(model), "--input", str(data), "--output",
            str(out), "--prompt-column", "prompt", "--max-new-tokens", str(max_new_tokens), "--temperature", "0",
            "--no-progress", "--set", "sampling.ignore_eos=true", "--set", "engine.device=cpu"]


def run_config(name: str, base: list[str], out: Path) -> float:
    """Wall seconds of one configuration (all its processes, started together)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    commands = {
        "1 process": [base],
        "2 shards": [base + ["--shard", "0/2"], base + ["--shard", "1/2"]],
        "ray 1 replica": [base + ["--executor", "ray", "--set", "cluster.num_replicas=1"]],
        "ray 2 replicas": [base + ["--executor", "ray", "--set", "cluster.num_replicas=2"]],
    }[name]
    start = time.perf_counter()
    processes = [subprocess.Popen(c + ["--output", str(out)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for c in commands]
    for process in processes:
        stdout, stderr = process.communicate()
        assert process.returncode == 0, f"{name}: {stderr[-2000:]}"
    return time.perf_counter() - start


def outputs(out: Path) -> list:
    table = pq.read_table(out, columns=["row_index", "completion_token_ids"]).sort_by("row_index")
    return table.column("completion_token_ids").to_pylist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from jobs.convert_llama2c import convert_llama2c

    work = Path(tempfile.mkdtemp(prefix="cbrun-scale-"))
    model = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", work / "model")
    data = work / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"Once upon a time, {('Lily', 'Tom', 'Sue')[i % 3]} found {i} "
                                        for i in range(args.rows)]}), data, row_group_size=32)
    base = job_args(model, data, work / "unused", args.max_new_tokens)
    names = ["1 process", "2 shards", "ray 1 replica", "ray 2 replicas"]
    times: dict[str, list[float]] = {n: [] for n in names}
    reference = None
    for repeat in range(args.repeats):
        for k in range(len(names)):
            name = names[(k + repeat) % len(names)]
            out = work / f"out-{repeat}-{name.replace(' ', '-')}"
            times[name].append(run_config(name, base, out))
            got = outputs(out)
            reference = reference if reference is not None else got
            assert got == reference, f"{name}: outputs differ from the first run's"
            print(f"repeat {repeat} {name}: {times[name][-1]:.1f} s", file=sys.stderr)
    single = statistics.median(times["1 process"])
    print(f"rows {args.rows}, max_new_tokens {args.max_new_tokens}, greedy, stories260K, {args.repeats} "
          f"interleaved repeats; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average at end {os.getloadavg()[0]:.1f}\n")
    print("| configuration | wall s (median) | all runs s | rows/s | vs 1 process |")
    print("|---|---|---|---|---|")
    for name in names:
        median = statistics.median(times[name])
        runs = ", ".join(f"{t:.1f}" for t in times[name])
        print(f"| {name} | {median:.1f} | {runs} | {args.rows / median:.1f} | {single / median:.2f}x |")
    overhead = (statistics.median(times["ray 1 replica"]) - single) / args.rows
    print(f"\nRay overhead per row (ray 1 replica - 1 process, per row): {1000 * overhead:.1f} ms; "
          f"every configuration's outputs equal the single process's.")


if __name__ == "__main__":
    main()
