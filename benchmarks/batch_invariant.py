"""The cost of ``engine.batch_invariant``: sampled rows with it "on" and "off", on the CPU, at 1 and 2 threads.

Usage (from the repository root)::

    python -m benchmarks.batch_invariant [--workload random-llama-30m] [--rows 64] [--rounds 3] [--jsonl FILE]
    python -m benchmarks.batch_invariant --device cuda --threads 1      # on a GPU: the Triton invariant kernels

Each run is its own process (``--one THREADS MODE``): it builds a ``cbrun bench`` workload (``random-llama-30m``:
a random 40M Llama, prompts of GSM8K's lengths, ``max_new_tokens`` 16..256; ``vllm-random-llama``: prompts of 40
to 300 ids, which weighs the invariant attention's one-row prefill tiles), samples every row at temperature 0.8
with its own seed (``ignore_eos``, so both modes generate the same number of tokens), with 512 batch tokens and 128
requests, and times one ``LLMEngine.generate`` over all rows. The settings run round-robin ``--rounds`` times; the
table gives each setting's median generated tokens/s, "on" against "off", and whether every run of a mode drew
the same tokens. ``--device cuda`` runs the same on a GPU, where "on" runs the Triton invariant kernels and turns
CUDA graphs off (docs/gpu.md, "Batch invariance on the GPU"), so the ratio prices both.
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

MODES = ("off", "on")


def one_run(workload_name: str, rows: int, threads: int, mode: str, model_dir: Path, device: str = "cpu") -> dict:
    """One timed generate in this process; returns its figures."""
    import torch

    from cbrun.bench.workloads import build_workload
    from cbrun.engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as scratch:
        workload = build_workload(workload_name, rows, (16, 256), 0, model_dir, Path(scratch))
    config = EngineConfig(
        max_batch_tokens=512, max_requests_per_batch=128, num_threads=threads, batch_invariant=mode, device=device
    )
    engine = LLMEngine.from_pretrained(str(workload.model_dir), config)
    requests = [
        (i, prompt, SamplingParams(max_new_tokens=m, temperature=0.8, seed=1000 + i, ignore_eos=True))
        for i, (prompt, m) in enumerate(zip(workload.prompts, workload.max_new_tokens))
    ]
    start = time.perf_counter()
    outputs = list(engine.generate(requests, max_in_flight=len(requests)))
    wall = time.perf_counter() - start
    tokens = [o.output_token_ids for o in sorted(outputs, key=lambda o: o.request_id)]
    num_tokens = sum(map(len, tokens))
    return dict(
        workload=workload_name,
        threads=threads,
        mode=mode,
        tokens=num_tokens,
        wall=wall,
        tok_s=num_tokens / wall,
        outputs=hashlib.sha256(str(tokens).encode()).hexdigest()[:12],
    )


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="random-llama-30m", choices=("random-llama-30m", "vllm-random-llama"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--model-dir", type=Path, help="where the random Llama is built (reused when it exists)")
    parser.add_argument("--jsonl", help="also write every run here, one JSON object per line")
    parser.add_argument("--device", default="cpu", help="cpu (the default) or cuda")
    parser.add_argument("--one", nargs=2, metavar=("THREADS", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"cbrun-{args.workload}"
    if args.one:
        print(json.dumps(one_run(args.workload, args.rows, int(args.one[0]), args.one[1], model_dir, args.device)))
        return 0
    settings = [(int(t), mode) for t in args.threads.split(",") for mode in MODES]
    runs = []
    for _ in range(args.rounds):
        for threads, mode in settings:
            command = [sys.executable, "-m", "benchmarks.batch_invariant", "--workload", args.workload]
            command += ["--rows", str(args.rows), "--model-dir", str(model_dir), "--device", args.device]
            command += ["--one", str(threads), mode]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), file=sys.stderr)
    if args.jsonl:
        Path(args.jsonl).write_text("".join(json.dumps(r) + "\n" for r in runs))
    tok_s = {s: sorted(r["tok_s"] for r in runs if (r["threads"], r["mode"]) == s) for s in settings}
    median = {s: statistics.median(values) for s, values in tok_s.items()}
    print(
        f"{args.workload} on {args.device}, {args.rows} sampled rows (temperature 0.8, seeded), {args.rounds} rounds\n"
    )
    print(
        "| threads | batch_invariant | generated tok/s (median) | min - max | on vs off, same threads | same tokens every run |"
    )
    print("|---|---|---|---|---|---|")
    for threads, mode in settings:
        values = tok_s[(threads, mode)]
        same = len({r["outputs"] for r in runs if (r["threads"], r["mode"]) == (threads, mode)}) == 1
        ratio = median[(threads, mode)] / median[(threads, "off")]
        print(
            f"| {threads} | {mode} | {median[(threads, mode)]:.0f} | {values[0]:.0f} - {values[-1]:.0f} | "
            f"{ratio:.2f}x | {same} |"
        )
    on = {r["outputs"] for r in runs if r["mode"] == "on"}
    print(f"\n'on' drew {'the same' if len(on) == 1 else 'other'} tokens at every thread count run ({args.threads})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
