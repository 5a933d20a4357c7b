"""``cbrun bench``: one workload through several backends in one command, side by side with transformers.

The pieces: ``workloads`` (the rows), ``backends`` (cbrun and transformers, each run in a process of its own),
``measure`` (clocks, memory, FLOPs), ``report`` (the table and JSON) and this command, which runs the backends
round-robin ``--repeats`` times. ``--workload engine-overhead`` runs ``benchmarks.cbrun_bench.overhead`` instead:
host time per engine step on a model whose forward pass costs next to nothing; ``--workload speculative`` runs
``benchmarks.cbrun_bench.speculative``: speculative decoding off / ngram / draft at several batch sizes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.cbrun_bench.backends import (BACKENDS, BackendSpec, quiet_transformers, run_backend, run_isolated,
                                             warm_up)
from benchmarks.cbrun_bench.measure import ModelCost, RunResult, machine_info, measure_matmul_gflops
from benchmarks.cbrun_bench.report import add_ratios, format_report, median_runs, summarize
from benchmarks.cbrun_bench.workloads import DEFAULT_ROWS, SHARED_ENV, WORKLOADS, Workload, build_workload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="cbrun bench", description=(
        "Run one workload through several backends (" + ", ".join(BACKENDS) + "), each run in its own process, "
        "and print a side-by-side table: throughput, prefix-cache hits, TTFT/ITL, peak memory, and whether each "
        "backend's greedy outputs equal cbrun's. With --repeats N each row is the backend's median run by wall "
        "time."))
    p.add_argument("--workload", choices=(*WORKLOADS, "engine-overhead", "speculative"),
                   default="gsm8k-stories260k",
                   help="gsm8k-stories260k: GSM8K test questions on stories260K; gsm8k-long: the same with "
                   "max_new_tokens = min(256, 512 - prompt); random-llama-30m: random ids of the same lengths on a "
                   "random 40M Llama; gsm8k-fewshot: the questions after a shared 1-shot GSM8K exemplar on "
                   "stories260K (prefix sharing); engine-overhead: host time per step on a near-free model "
                   "(cbrun bench --workload engine-overhead --help); speculative: speculation off / ngram / draft "
                   "on a story-repeat workload and workload 1 (cbrun bench --workload speculative --help)")
    p.add_argument("--rows", type=int, help=f"GSM8K test questions to take, from the first (gsm8k-fewshot leaves "
                   f"out those too long for the context) (default {DEFAULT_ROWS})")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="comma-separated, from " + ", ".join(BACKENDS) + "; cbrun always runs (the reference)")
    p.add_argument("--batch-sizes", default="8,32,64", help="static batch sizes of hf-generate and cbrun-static")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run the whole backend list N times round-robin (b1, b2, ..., b1, b2, ...), each run in its "
                   "own process; the table shows each backend's median run by wall time (of an even N, the faster "
                   "middle one) and the min-max of its generated tok/s; the JSON keeps every run")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, the same for every backend but "
                   "cbrun-defaults (which runs the engine's own choice, engine.num_threads = auto)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="cbrun and hf-cb token budget per step")
    p.add_argument("--max-requests", type=int, default=128, help="cbrun and hf-cb requests per step")
    p.add_argument("--page-size", type=int, default=16, help="cbrun and hf-cb tokens per KV block")
    p.add_argument("--max-new-tokens", default="16:256", metavar="LOW:HIGH",
                   help="per-row max_new_tokens drawn uniformly in [LOW, HIGH]")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-row lengths and of random prompts")
    p.add_argument("--model-dir", type=Path, help="model directory to reuse (built there when empty)")
    p.add_argument("--shared", type=Path, help=f"folder with data/gsm8k_*.parquet and models/stories260K (default: "
                   f"${SHARED_ENV}, else shared/ beside the checkout)")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run all backends in this process (faster start; no per-backend peak memory)")
    return p


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backend(s) {sorted(unknown)}; choose from {BACKENDS}")
    args.backends = ["cbrun"] + [b for b in BACKENDS[1:] if b in args.backends]
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        low, high = (int(x) for x in args.max_new_tokens.split(":"))
    except ValueError:
        parser.error("--batch-sizes takes integers like 8,32,64 and --max-new-tokens LOW:HIGH like 16:256")
    if min(args.batch_sizes) < 1 or not 1 <= low <= high or args.threads < 1 or args.repeats < 1:
        parser.error("batch sizes, threads, repeats and max-new-tokens bounds must be positive, with LOW <= HIGH")
    args.new_tokens = (low, high)
    args.rows = args.rows or DEFAULT_ROWS[args.workload]
    return args


def backend_specs(args) -> list[BackendSpec]:
    """The backend runs of one round: cbrun first (the reference), then the others, each sweep setting its own."""
    from engine import EngineConfig

    config = EngineConfig(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                          max_requests_per_batch=args.max_requests, num_threads=args.threads)
    specs = [BackendSpec("cbrun", None, config, args.threads)]
    for backend in args.backends[1:]:
        if backend == "cbrun-defaults":
            specs.append(BackendSpec(backend, None, EngineConfig(), None))
        elif backend == "cbrun-nosharing":
            specs.append(BackendSpec(backend, None, replace(config, allow_block_sharing=False), args.threads))
        elif backend == "hf-cb":
            specs.append(BackendSpec(backend, None, config, args.threads))
        else:
            specs.extend(BackendSpec(backend, size, config, args.threads) for size in args.batch_sizes)
    return specs


def run_backends(args, workload: Workload) -> list[RunResult]:
    """Run the round of ``backend_specs`` ``args.repeats`` times, round-robin; log each run.

    NOTE: round-robin rather than each backend's repeats back to back, so a slow spell of the machine falls on
    every backend alike instead of on one.

    Returns:
        Every run in the order run; the first is round 1's cbrun, the outputs' reference.
    """
    specs = backend_specs(args)
    if not args.isolate:
        warm_up()
    results: list[RunResult] = []
    for repeat in range(1, args.repeats + 1):
        for spec in specs:
            if spec.backend == "hf-cb":
                spec.num_blocks = results[0].info["num_blocks"]
            result = run_isolated(spec, workload) if args.isolate else run_backend(spec, workload)
            result.repeat = repeat
            results.append(result)
            _log(result, args.repeats)
            gc.collect()
    return results


def _log(result: RunResult, repeats: int) -> None:
    generated = sum(len(o) for o in result.outputs)
    label = f"{result.backend} {result.setting}".strip()
    which = f" (repeat {result.repeat}/{repeats})" if repeats > 1 else ""
    print(f"[bench] {label}{which}: {generated} tokens in {result.wall_s:.1f} s "
          f"({generated / result.wall_s:.0f} tok/s), load {result.load_avg[0]:.2f} -> {result.load_avg[1]:.2f}",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; write JSON when asked. Returns 0, or 2 for a bad workload."""
    argv = sys.argv[1:] if argv is None else argv
    if "engine-overhead" in argv:  # its own options; see benchmarks.cbrun_bench.overhead
        from benchmarks.cbrun_bench.overhead import main as overhead_main

        return overhead_main([a for a in argv if a not in ("--workload", "engine-overhead")])
    if "speculative" in argv:  # its own options; see benchmarks.cbrun_bench.speculative
        from benchmarks.cbrun_bench.speculative import main as speculative_main

        return speculative_main([a for a in argv if a not in ("--workload", "speculative")])
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="cbrun-bench-") as scratch:
        try:
            workload = build_workload(args.workload, args.rows, args.new_tokens, args.seed, args.model_dir,
                                      Path(scratch), args.shared)
        except ValueError as e:
            print(f"cbrun bench: {e}", file=sys.stderr)
            return 2
        machine = machine_info(args.threads)
        matmul_gflops = measure_matmul_gflops()
        cost = ModelCost.of(workload.model_dir)
        load_start = os.getloadavg()
        results = run_backends(args, workload)
    runs = [summarize(r, workload, results[0] if i else None, cost, matmul_gflops) for i, r in enumerate(results)]
    rows = median_runs(runs)
    add_ratios(rows)
    report = dict(workload=args.workload, description=workload.description, command=_command(argv),
                  machine=machine, settings=_settings(args), model_params=cost.total_params,
                  matmul_ceiling_gflop_s=matmul_gflops, load_avg_start=load_start, load_avg_end=os.getloadavg(),
                  repeats=args.repeats, results=rows, runs=runs)
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def _command(argv: list[str]) -> str:
    return "cbrun bench " + shlex.join(argv)


def _settings(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


if __name__ == "__main__":
    sys.exit(main())
