"""Output-layer scale: a many-row job of 1-token completions on a near-free model, local and on S3 (moto).

Measures what the output layer costs once the model costs almost nothing (the host-bound case a GPU job is in):
rows/s and host time per row of the whole ``cbrun run``, its peak RSS, the time a rerun over the finished output
takes to read which rows are done (resume's cost), and the part-file count before and after ``cbrun compact``.
The S3 runs go to moto's server on 127.0.0.1 (an S3 protocol server in Python: its per-request cost is far above
a real store's, so S3 rows/s here are a lower bound).

    python -m benchmarks.storage_scale --rows 200000 --store local --store s3 \\
        --results benchmarks/results-storage-scale.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ENGINE_SETS = (
    "engine.max_requests_per_batch=256",
    "engine.max_batch_tokens=8192",
    "engine.page_size=16",
    "sampling.ignore_eos=true",
)


def write_input(path: Path, num_rows: int) -> None:
    """``num_rows`` short prompts (about 12 byte tokens each), in row groups of 64k rows."""
    ids = pa.array([f"r{i}" for i in range(num_rows)])
    prompts = pa.array([f"row {i} says" for i in range(num_rows)])
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), path, row_group_size=65536)


def cbrun(args: list[str], env: dict) -> tuple[float, int, str]:
    """Run ``cbrun`` in a subprocess; returns (wall seconds, exit code, output tail)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "cbrun.jobs.cli", *args], env=env, capture_output=True, text=True, check=False
    )
    return time.perf_counter() - start, done.returncode, (done.stdout + done.stderr)[-2000:]


def count_parts(output: str, env: dict) -> int:
    from cbrun.jobs.output.output_dir import open_output

    return open_output(output).parts.num_parts()


def measure(store: str, num_rows: int, model: Path, work: Path, env: dict, s3_prefix: str | None) -> dict:
    source = work / "in.parquet"
    output = f"{s3_prefix}/out-{num_rows}" if store == "s3" else str(work / f"out-{store}-{num_rows}")
    if store == "s3":
        from cbrun.jobs.store.files import write_file

        write_file(f"{s3_prefix}/in-{num_rows}.parquet", source.read_bytes())
        source = f"{s3_prefix}/in-{num_rows}.parquet"
    args = [
        "run",
        "--model",
        str(model),
        "--input",
        str(source),
        "--output",
        output,
        "--prompt-column",
        "prompt",
        "--id-column",
        "id",
        "--max-new-tokens",
        "1",
        "--temperature",
        "0",
        "--no-progress",
        *[a for s in ENGINE_SETS for a in ("--set", s)],
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, code, tail = cbrun(args, env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert code == 0, tail
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    from cbrun.jobs.output.output_dir import open_output

    stats = open_output(output).read_stats()
    start = time.perf_counter()
    state = open_output(output).read_state(num_rows)  # resume's own cost: the done bitmap from the parts/records
    read_state_s = time.perf_counter() - start
    assert state.done.all()
    resume_wall, code, tail = cbrun(args, env)  # a rerun over the finished output: reads what is done, stops
    assert code == 0 and "already finished" in tail, tail
    parts_before = count_parts(output, env)
    compact_wall, code, tail = cbrun(["compact", output], env)
    assert code == 0, tail
    return {
        "store": store,
        "rows": num_rows,
        "wall_s": wall,
        "rows_per_s": num_rows / wall,
        "host_us_per_row": 1e6 * cpu / num_rows,
        "generation_s": stats.get("generation_s"),
        "peak_rss_mib": stats.get("peak_memory_mib"),
        "resume_s": resume_wall,
        "read_state_s": read_state_s,
        "parts_before": parts_before,
        "parts_after": count_parts(output, env),
        "compact_s": compact_wall,
    }


def start_s3(env: dict) -> tuple[object, str]:
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    aws = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    env.update(aws)
    os.environ.update(aws)
    boto3.client("s3", endpoint_url=aws["AWS_ENDPOINT_URL"], region_name="us-east-1").create_bucket(Bucket="bench")
    return server, "s3://bench"


def table(results: list[dict]) -> str:
    lines = [
        "| store | rows | wall s | rows/s | host us/row | peak RSS MiB | rerun s (done-state s) | "
        "parts -> compacted | compact s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['store']} | {r['rows']} | {r['wall_s']:.1f} | {r['rows_per_s']:.0f} | "
            f"{r['host_us_per_row']:.0f} | {r['peak_rss_mib']:.0f} | {r['resume_s']:.1f} ({r['read_state_s']:.2f}) | "
            f"{r['parts_before']} -> {r['parts_after']} | {r['compact_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000])
    parser.add_argument("--store", action="append", choices=("local", "s3"))
    parser.add_argument("--results", help="append the table and the raw numbers to this markdown file")
    args = parser.parse_args()
    stores = args.store or ["local"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    server, prefix = start_s3(env) if "s3" in stores else (None, None)
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="cbrun-storage-scale-") as tmp:
            work = Path(tmp)
            from cbrun.jobs.cli.demo import build_demo_model

            model = build_demo_model(work / "model")
            for num_rows in args.rows:
                write_input(work / "in.parquet", num_rows)
                for store in stores:
                    results.append(measure(store, num_rows, model, work, env, prefix))
                    print(json.dumps(results[-1]), flush=True)
    finally:
        if server is not None:
            server.stop()
    text = table(results)
    print(text)
    if args.results:
        with open(args.results, "a") as f:
            f.write(f"\n{text}\n\n```\n" + "\n".join(json.dumps(r) for r in results) + "\n```\n")


if __name__ == "__main__":
    main()
