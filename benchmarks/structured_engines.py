"""xgrammar-served rows against llguidance-served rows and unconstrained rows, and a job whose rows each bring a
different schema (compile cost per distinct schema).

The model, tokenizer, prompts and schema are ``cbrun bench --workload structured``'s (``cbrun.bench.structured``:
a random Llama, hidden 256, 4 layers, with a 32000-token byte-level BPE tokenizer trained on GSM8K train; the first
``--rows`` GSM8K test questions; ``SCHEMA``), greedy, the same engine settings in every run, one fresh engine each:

- ``xgrammar``: every row under ``SCHEMA``, ``structured_outputs_backend = "xgrammar"``;
- ``llguidance``: the same rows, ``structured_outputs_backend = "guidance"`` (its masks fill the same step bitmask);
- ``unconstrained, same lengths``: the rows free, each generating as many tokens as its xgrammar row did
  (``ignore_eos``), so every run has the same batch at every step.

A short unconstrained warm-up run comes first (the process's first engine pays one-time costs).

Then ``--distinct`` rows, each under its own schema (``SCHEMA`` with a row-specific enum and string bounds), once per
engine: tok/s, and the compile time of each distinct schema on the compile thread (median, p99; llguidance compiles
lazily, so its first masks are paid in the first steps instead: its tok/s carries that).

Run: ``PYTHONPATH=. python -m benchmarks.structured_engines [--rows 256] [--distinct 128] [--repeats 1] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from cbrun.bench.measure import git_commit, machine_info
from cbrun.bench.structured import SCHEMA, build_model
from cbrun.bench.workloads import gsm8k_questions


def distinct_schema(i: int) -> dict:
    """``SCHEMA`` made row ``i``'s own: its own enum values and string bounds (another grammar to compile)."""
    schema = copy.deepcopy(SCHEMA)
    schema["properties"]["unit"] = {"enum": [f"unit{i}", f"kind{i % 7}", "other"]}
    schema["properties"]["check"]["properties"]["note"]["maxLength"] = 8 + i % 17
    return schema


def run(config, model_dir: Path, prompts: list[list[int]], params: list) -> dict:
    """One run on a fresh engine: generated tokens / wall second, rows ended by stop, errors, per-compile times."""
    from cbrun.engine import LLMEngine

    engine = LLMEngine.from_pretrained(str(model_dir), config)
    start, cpu = time.perf_counter(), time.process_time()
    outputs = sorted(
        engine.generate((i, p, q) for i, (p, q) in enumerate(zip(prompts, params))), key=lambda o: o.request_id
    )
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    stats = engine.stats
    compiler = engine._grammar_compiler
    return {
        "wall_s": wall,
        "tokens": stats.num_generated_tokens,
        "tok_s": stats.num_generated_tokens / wall,
        "cpu_s": cpu,
        "steps": stats.num_steps,
        "mask_ms": 1000 * stats.grammar_mask_seconds / max(1, stats.num_grammar_mask_steps),
        "stop": sum(o.finish_reason == "stop" for o in outputs),
        "errors": sum(o.finish_reason == "error" for o in outputs),
        "lengths": [len(o.output_token_ids) for o in outputs],
        "texts": [
            o.text if o.text is not None else engine.tokenizer.decode(o.output_token_ids, skip_special_tokens=True)
            for o in outputs
        ],
        "compiles": [s for _, s in compiler.compile_times] if compiler is not None else [],
    }


def _median_round(rounds: list[dict]) -> dict:
    """Per run kind, the round whose ratio to that round's unconstrained run is the median (``ratio`` and
    ``cpu_ratio`` added: each run's tok/s and tokens per CPU second over its own round's unconstrained run's)."""
    base = "unconstrained, same lengths"
    for runs in rounds:
        for r in runs.values():
            r["ratio"] = r["tok_s"] / runs[base]["tok_s"]
            r["cpu_ratio"] = r["tokens"] / r["cpu_s"] / (runs[base]["tokens"] / runs[base]["cpu_s"])
    return {name: sorted((runs[name] for runs in rounds), key=lambda r: r["ratio"])[len(rounds) // 2]
            for name in rounds[0]}  # fmt: skip


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--distinct", type=int, default=128, help="rows of the per-distinct-schema job")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="rounds of the three runs; the median round's ratio is kept")
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--shared", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.load_start = os.getloadavg()[0]
    from dataclasses import replace

    from cbrun.engine.config import EngineConfig
    from cbrun.engine.sampling_params import SamplingParams
    from cbrun.engine.structured_output import StructuredOutputsParams
    from cbrun.engine.structured_output.validate import is_valid_output

    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="cbrun-engines-")) / "model"
    tokenizer = build_model(model_dir, args.shared)
    prompts = tokenizer(gsm8k_questions(max(args.rows, args.distinct), args.shared))["input_ids"]
    config = EngineConfig(
        device="cpu", num_threads=args.threads, max_requests_per_batch=args.rows, max_batch_tokens=4096
    )
    engines = {"xgrammar": replace(config, structured_outputs_backend="xgrammar"),
               "llguidance": replace(config, structured_outputs_backend="guidance")}  # fmt: skip
    free = SamplingParams(max_new_tokens=args.max_new_tokens)
    so = StructuredOutputsParams(json=SCHEMA)
    rows = prompts[: args.rows]
    run(config, model_dir, rows[:8], [free.replace(max_new_tokens=8)] * 8)  # warm-up: the process's first engine
    rounds = []
    for _ in range(args.repeats):  # each round: the three runs back to back, their ratios taken within it
        runs = {
            name: run(cfg, model_dir, rows, [free.replace(structured_outputs=so)] * len(rows))
            for name, cfg in engines.items()
        }
        same = [free.replace(max_new_tokens=n, ignore_eos=True) for n in runs["xgrammar"]["lengths"]]
        runs["unconstrained, same lengths"] = run(config, model_dir, rows, same)
        rounds.append(runs)
    runs = _median_round(rounds)
    valid = {name: sum(bool(is_valid_output(t, so)) for t in runs[name]["texts"]) for name in engines}

    distinct_rows = prompts[: args.distinct]
    schemas = [StructuredOutputsParams(json=distinct_schema(i)) for i in range(args.distinct)]
    distinct = {name: run(cfg, model_dir, distinct_rows, [free.replace(structured_outputs=s) for s in schemas])
                for name, cfg in engines.items()}  # fmt: skip
    distinct_valid = {
        name: sum(bool(is_valid_output(t, s)) for t, s in zip(r["texts"], schemas)) for name, r in distinct.items()
    }
    report = _report(args, runs, valid, distinct, distinct_valid)
    print(report)
    if args.out is not None:
        args.out.write_text(report)
    return 0


def _report(args, runs: dict, valid: dict, distinct: dict, distinct_valid: dict) -> str:
    lines = [
        f"# benchmarks.structured_engines ({datetime.date.today()}, commit {git_commit()})",
        "",
        f"Machine: {machine_info(args.threads)['cpu']}, cpu, {args.threads} threads (llguidance fills its masks on "
        f"as many), load average {args.load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; shared with other jobs while measured. Greedy, "
        f"max_new_tokens {args.max_new_tokens}, one run each, a fresh engine per run. Model: random Llama (hidden "
        "256, 4 layers, vocab 32000), 32000-token byte-level BPE trained on GSM8K train.",
        "",
        f"## One schema, {args.rows} rows (`cbrun.bench.structured.SCHEMA`)",
        "",
        f"{args.repeats} round(s) of the three runs; per run kind, the round with the median ratio to its own "
        "unconstrained run.",
        "",
        "| run | generated tokens | steps | wall s | tok/s | vs unconstrained | CPU s | tok / CPU s vs unconstrained "
        "| mask fill ms/step | stop | valid |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        v = f"{valid[name]} / {args.rows}" if name in valid else "-"
        lines.append(
            f"| {name} | {r['tokens']} | {r['steps']} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | "
            f"{r['ratio']:.2f}x | {r['cpu_s']:.1f} | {r['cpu_ratio']:.2f}x | "
            f"{r['mask_ms']:.2f} | {r['stop']} / {args.rows} | {v} |"
        )
    lines += [
        "",
        f"## A distinct schema per row, {args.distinct} rows",
        "",
        "| engine | distinct schemas compiled | compile s median | compile s p99 | compile s total | wall s | tok/s | "
        "stop | valid | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in distinct.items():
        c = r["compiles"]
        lines.append(
            f"| {name} | {len(c)} | {statistics.median(c):.4f} | {_p99(c):.4f} | {sum(c):.2f} | {r['wall_s']:.1f} | "
            f"{r['tok_s']:.1f} | {r['stop']} / {args.distinct} | {distinct_valid[name]} / {args.distinct} | "
            f"{r['errors']} |"
        )
    lines += [
        "",
        "The first compile of each engine includes reading the tokenizer's vocabulary (its p99 here). llguidance "
        "compiles lazily: its per-schema cost is mostly paid in its first mask fills, inside the run's wall time. "
        "CPU s: the process's CPU time during the run (all its threads): on a loaded machine a steadier measure of "
        "the work than wall time at one thread (at two, torch's threads spin while they wait, and that counts).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
