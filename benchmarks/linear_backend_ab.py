"""``linear_backend = "torch"`` against ``"auto"`` (oneDNN for large weights) on workload 2, at 1 and 2 threads.

Usage (from the repository root)::

    python -m benchmarks.linear_backend_ab [--rounds 3] [--model-dir DIR] [--jsonl FILE]

Each run is its own process (``--one THREADS BACKEND``): it builds ``cbrun bench``'s random-llama-30m workload
(64 rows, random 40M Llama, ``max_new_tokens`` 16..256), loads the engine with 512 batch tokens and 128 requests,
and times one ``LLMEngine.generate`` over all rows. The four settings run round-robin ``--rounds`` times; the
table gives each setting's median generated tokens/s and whether every run's outputs are the same tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = [(1, "torch"), (1, "auto"), (2, "torch"), (2, "auto")]


def one_run(threads: int, backend: str, model_dir: Path) -> dict:
    """One timed generate in this process; returns its figures."""
    import torch

    from cbrun.bench.workloads import build_workload
    from cbrun.engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as scratch:
        workload = build_workload("random-llama-30m", 64, (16, 256), 0, model_dir, Path(scratch))
    config = EngineConfig(max_batch_tokens=512, max_requests_per_batch=128, num_threads=threads, linear_backend=backend)
    engine = LLMEngine.from_pretrained(str(workload.model_dir), config)
    requests = [
        (i, prompt, SamplingParams(max_new_tokens=m, stop_token_ids=workload.stop_token_ids))
        for i, (prompt, m) in enumerate(zip(workload.prompts, workload.max_new_tokens))
    ]
    cpu, start = time.process_time(), time.perf_counter()
    outputs = list(engine.generate(requests, max_in_flight=len(requests)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = [o.output_token_ids for o in sorted(outputs, key=lambda o: o.request_id)]
    num_tokens = sum(map(len, tokens))
    return dict(
        threads=threads,
        backend=backend,
        tokens=num_tokens,
        wall=wall,
        cpu=cpu,
        tok_s=num_tokens / wall,
        outputs=hashlib.sha256(str(tokens).encode()).hexdigest()[:12],
    )


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "cbrun-random-llama-30m",
        help="where the random 40M Llama is built (reused when it exists)",
    )
    parser.add_argument("--jsonl", help="also write every run here, one JSON object per line")
    parser.add_argument("--one", nargs=2, metavar=("THREADS", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(int(args.one[0]), args.one[1], args.model_dir)))
        return 0
    runs = []
    for _ in range(args.rounds):
        for threads, backend in SETTINGS:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.linear_backend_ab",
                    "--model-dir",
                    str(args.model_dir),
                    "--one",
                    str(threads),
                    backend,
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), file=sys.stderr)
    if args.jsonl:
        Path(args.jsonl).write_text("".join(json.dumps(r) + "\n" for r in runs))
    median = {s: statistics.median(r["tok_s"] for r in runs if (r["threads"], r["backend"]) == s) for s in SETTINGS}
    same = len({r["outputs"] for r in runs}) == 1
    print(
        "| threads | linear_backend | generated tok/s (median) | vs torch, same threads | vs 1 thread, same backend |"
    )
    print("|---|---|---|---|---|")
    for threads, backend in SETTINGS:
        tok_s = median[(threads, backend)]
        print(
            f"| {threads} | {backend} | {tok_s:.0f} | {tok_s / median[(threads, 'torch')]:.2f}x | "
            f"{tok_s / median[(1, backend)]:.2f}x |"
        )
    print(f"\noutputs: {'the same tokens in every run' if same else 'DIFFER between runs'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
