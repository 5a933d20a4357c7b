"""``cbrun bench --workload speculative``: speculative decoding off / ngram / draft at several batch sizes.

Two workloads, both stories260K, greedy, stop token 1 (BOS, as llama2.c), one CPU thread:

- ``story-repeat``: outputs that repeat their inputs, as extraction, rewriting and summarisation jobs do. Each of
  llama2.c's 12 greedy goldens for stories260K is a told story (prompt + output, BOS dropped). A request's prompt is
  that story, then BOS and the story's first ``m`` tokens again; it asks for the rest of the story (capped at the
  512-token context). ``m`` runs over 4, 8, 12, ... until there are enough requests.
- ``gsm8k-stories260k``: workload 1 of ``cbrun bench`` (GSM8K test questions, ``max_new_tokens`` uniform in
  16..256, seed 0), whose outputs do not repeat their prompts: speculation must not make it slower.

For each workload and ``max_requests_per_batch`` in ``--batches`` (default 1, 8, 128), every mode runs on the same
requests with a fresh engine (default settings otherwise: ``num_speculative_tokens`` 8, ``ngram_min`` 1,
``ngram_max`` 4, ``speculative_max_batch`` 16, so at 128 speculation runs only in the tail, ``speculative_row_cost``
0.03; ``--engine KEY=VALUE`` changes any setting for every run, e.g. to re-measure the row cost). Requests per run
grow with the batch (``STORY_REQUESTS``, ``GSM8K_ROWS``) so each run takes a few seconds. The runs go round-robin
(every workload, batch and mode once, then again) ``--repeats`` times; a row gives each mode's median generated
tokens/s by wall time (from the first request handed to the engine to the last output) and the ratio to off's
median, and checks that every run's outputs and ``num_generated_tokens`` equal off's first run.

``draft`` runs with ``draft_model = --draft-model``, by default stories260K itself (the only model with its
tokenizer here: every proposal is accepted, and the draft doubles the compute, so it shows the mechanism's cost,
not a speed-up); where the engine cannot build it, its rows say "not available" and why.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cbrun.bench.measure import git_commit, machine_info
from cbrun.bench.report import markdown_table
from cbrun.bench.workloads import STORIES_CONTEXT, _stories_model, build_workload, stories260k_path

MODES = ("off", "ngram", "draft")
WORKLOADS = ("story-repeat", "gsm8k-stories260k")
#: story-repeat requests per run, by max_requests_per_batch (others: the batch size).
STORY_REQUESTS = {1: 4, 8: 16}
#: GSM8K rows per run, by max_requests_per_batch (others: twice the batch size).
GSM8K_ROWS = {1: 6, 8: 32}
BOS = 1
#: The block of a Markdown page (docs/performance.md) that ``--readme`` rewrites.
README_START, README_END = "<!-- speculative-table:start -->", "<!-- speculative-table:end -->"


def story_repeat_requests(num_requests: int, shared: Path | None = None) -> list[tuple[int, list[int], int]]:
    """``(request_id, prompt, max_new_tokens)`` of ``num_requests`` story-continuation requests (module docstring)."""
    path = stories260k_path(shared) / "reference_greedy.jsonl"
    lines = [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
    stories = [[t for t in line["prompt_token_ids"] + line["output_token_ids"] if t != BOS] for line in lines]
    requests, m = [], 4
    while len(requests) < num_requests:
        for story in stories:
            prompt = [BOS] + story + [BOS] + story[:m]
            max_new = min(len(story) - m, STORIES_CONTEXT - len(prompt))
            if max_new > 0 and len(requests) < num_requests:
                requests.append((len(requests), prompt, max_new))
        m += 4
    return requests


def gsm8k_requests(rows: int, model_dir: Path, scratch: Path, shared: Path | None = None):
    """``(request_id, prompt, max_new_tokens)`` of workload 1's first ``rows`` rows."""
    workload = build_workload("gsm8k-stories260k", rows, (16, 256), 0, model_dir, scratch, shared)
    return [(i, p, m) for i, (p, m) in enumerate(zip(workload.prompts, workload.max_new_tokens))]


def num_requests(workload: str, batch: int) -> int:
    if workload == "story-repeat":
        return STORY_REQUESTS.get(batch, batch)
    return GSM8K_ROWS.get(batch, 2 * batch)


def mode_config(mode: str, batch: int, draft_model: Path, settings: dict | None = None):
    """The ``EngineConfig`` of one mode at one batch size, with ``settings`` (``--engine``) on top.

    Raises:
        ValueError, TypeError: when the engine does not support the mode (``draft`` before it is built) or a
            setting.
    """
    from cbrun.engine import EngineConfig

    extra = dict(draft_model=str(draft_model)) if mode == "draft" else {}
    return EngineConfig(max_requests_per_batch=batch, speculative=mode, num_threads=1, **extra, **(settings or {}))


def parse_settings(items: list[str]) -> dict:
    """``--engine KEY=VALUE`` items as a dict; a value is a Python literal (``0.03``, ``8``) or else a string.

    Raises:
        ValueError: for an item without ``=``.
    """
    import ast

    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine wants KEY=VALUE, got {item!r}")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    return settings


@dataclass
class Run:
    """One engine run: its speed, counters and outputs."""

    wall_s: float
    cpu_s: float
    generated: int
    num_generated_tokens: int
    steps: int
    acceptance: float
    tokens_per_verify: float
    outputs: dict = field(repr=False)

    @property
    def tok_s(self) -> float:
        return self.generated / self.wall_s


def run_once(model_dir: Path, config, requests) -> Run:
    """A fresh engine runs every request; timed from the first request handed to it to the last output."""
    from cbrun.engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(str(model_dir), config)
    triples = [(i, p, SamplingParams(max_new_tokens=m, stop_token_ids=(BOS,))) for i, p, m in requests]
    cpu, start = time.process_time(), time.perf_counter()
    outputs = {o.request_id: o.output_token_ids for o in engine.generate(triples, max_in_flight=len(triples))}
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    stats = engine.stats
    return Run(
        wall,
        cpu,
        sum(len(t) for t in outputs.values()),
        stats.num_generated_tokens,
        stats.num_steps,
        stats.acceptance_rate,
        stats.mean_tokens_per_verify_step,
        outputs,
    )


def run_all(args, model_dir: Path, scratch: Path) -> tuple[dict, dict]:
    """Every (workload, batch, mode) ``args.repeats`` times, round-robin.

    Returns:
        ``runs[(workload, batch, mode)]``: the runs in order; ``unavailable[mode]``: why a mode could not run.
    """
    _stories_model(model_dir, args.shared)  # converts the llama2.c checkpoint unless already there
    requests = {}
    for workload in args.workloads:
        for batch in args.batches:
            n = num_requests(workload, batch)
            requests[workload, batch] = (
                story_repeat_requests(n, args.shared)
                if workload == "story-repeat"
                else gsm8k_requests(n, model_dir, scratch, args.shared)
            )
    unavailable = {}
    for mode in args.modes:
        try:
            mode_config(mode, 1, args.draft_model or model_dir, args.settings)
        except (ValueError, TypeError) as e:
            unavailable[mode] = str(e)
    runs = {}
    for repeat in range(1, args.repeats + 1):
        for (workload, batch), reqs in requests.items():
            for mode in args.modes:
                if mode in unavailable:
                    continue
                run = run_once(model_dir, mode_config(mode, batch, args.draft_model or model_dir, args.settings), reqs)
                runs.setdefault((workload, batch, mode), []).append(run)
                print(
                    f"[speculative] {workload} batch {batch} {mode} (repeat {repeat}/{args.repeats}): "
                    f"{run.generated} tokens in {run.wall_s:.1f} s ({run.tok_s:.0f} tok/s), {run.steps} steps",
                    file=sys.stderr,
                    flush=True,
                )
    return runs, unavailable


def summarize(runs: dict, unavailable: dict, args) -> list[dict]:
    """One row per workload, batch and mode: medians over the repeats, the ratio to off, equality with off."""
    rows = []
    for workload in args.workloads:
        for batch in args.batches:
            off = runs.get((workload, batch, "off"))
            for mode in args.modes:
                row = dict(workload=workload, batch=batch, mode=mode)
                if mode in unavailable:
                    rows.append({**row, "unavailable": unavailable[mode]})
                    continue
                group = runs[(workload, batch, mode)]
                tok_s = statistics.median(r.tok_s for r in group)
                cpu_tok_s = statistics.median(r.generated / r.cpu_s for r in group)
                first = group[0]
                row.update(
                    requests=len(first.outputs),
                    generated=first.generated,
                    tok_s=tok_s,
                    tok_s_range=[min(r.tok_s for r in group), max(r.tok_s for r in group)],
                    cpu_tok_s=cpu_tok_s,
                    steps=first.steps,
                    acceptance=first.acceptance,
                    tokens_per_verify=first.tokens_per_verify,
                )
                if off:
                    reference = off[0]
                    row["vs_off"] = tok_s / statistics.median(r.tok_s for r in off)
                    row["cpu_vs_off"] = cpu_tok_s / statistics.median(r.generated / r.cpu_s for r in off)
                    row["outputs_equal"] = all(r.outputs == reference.outputs for r in group)
                    row["counts_equal"] = all(r.num_generated_tokens == reference.num_generated_tokens for r in group)
                rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    columns = (
        "workload",
        "batch",
        "requests",
        "mode",
        "gen tok/s",
        "min-max",
        "vs off",
        "vs off (CPU time)",
        "steps",
        "acceptance",
        "tokens per verify step",
        "outputs (and token counts) == off",
    )
    table = []
    for r in rows:
        if "unavailable" in r:
            cells = [r["workload"], r["batch"], "", r["mode"], f"not available: {r['unavailable']}"]
            cells += [""] * (len(columns) - len(cells))
        else:
            spec = r["mode"] != "off"
            equal = "reference" if not spec else "yes" if r.get("outputs_equal") and r.get("counts_equal") else "NO"
            cells = [
                r["workload"],
                r["batch"],
                r["requests"],
                r["mode"],
                f"{r['tok_s']:.0f}",
                f"{r['tok_s_range'][0]:.0f}-{r['tok_s_range'][1]:.0f}",
                f"{r.get('vs_off', 1):.2f}x",
                f"{r.get('cpu_vs_off', 1):.2f}x",
                r["steps"],
                f"{100 * r['acceptance']:.1f}%" if spec else "",
                f"{r['tokens_per_verify']:.2f}" if spec else "",
                equal,
            ]
        table.append(cells)
    return markdown_table(columns, table)


def format_report(rows: list[dict], args, argv: list[str], load_start, load_end) -> str:
    m = machine_info(1)
    return "\n".join(
        [
            "# Speculative decoding: off / ngram / draft on stories260K (`cbrun bench --workload speculative`)",
            "",
            f"Command: `cbrun bench --workload speculative {' '.join(argv)}`".rstrip() + "",
            "",
            f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}; commit "
            f"{git_commit()}; {m['date']}; load average (1/5/15 min) at start "
            f"{'/'.join(f'{v:.2f}' for v in load_start)}, end {'/'.join(f'{v:.2f}' for v in load_end)}.",
            "",
            "One CPU thread; engine defaults otherwise ("
            + _settings_text(args.settings)
            + "). Each row: the median of "
            f'{args.repeats} round-robin runs by generated tokens/s (wall time); "vs off" divides the medians; '
            '"vs off (CPU time)" does the same with process CPU time, steadier on a shared machine. Workloads and '
            "method: `cbrun/bench/speculative.py`.",
            "",
            format_table(rows),
            "",
        ]
    )


def _settings_text(settings: dict) -> str:
    """The speculation settings of the runs, e.g. "`num_speculative_tokens` 4, ...", from the engine's defaults."""
    from cbrun.engine import EngineConfig

    config = EngineConfig(**{k: v for k, v in settings.items() if k not in ("speculative", "draft_model")})
    names = ("num_speculative_tokens", "ngram_min", "ngram_max", "speculative_max_batch", "speculative_row_cost")
    text = ", ".join(f"`{name}` {getattr(config, name)}" for name in names)
    others = {k: v for k, v in settings.items() if k not in names}
    return text + "".join(f", `{k}` {v}" for k, v in others.items())


def write_readme_table(readme: Path, rows: list[dict]) -> None:
    """Replace the README block between ``README_START`` and ``README_END`` with the short table."""
    text = readme.read_text(encoding="utf-8")
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    lines = [
        "",
        "| workload | batch | mode | off tok/s | mode tok/s | vs off | acceptance | tokens per verify step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["workload"], r["batch"], r["mode"]): r for r in rows}
    for (workload, batch, mode), r in by_key.items():
        off = by_key.get((workload, batch, "off"))
        if mode == "off" or off is None:
            continue
        if "unavailable" in r:
            lines.append(f"| {workload} | {batch} | {mode} | {off['tok_s']:.0f} | not available | | | |")
            continue
        lines.append(
            f"| {workload} | {batch} | {mode} | {off['tok_s']:.0f} | {r['tok_s']:.0f} | {r['vs_off']:.2f}x | "
            f"{100 * r['acceptance']:.1f}% | {r['tokens_per_verify']:.2f} |"
        )
    readme.write_text(text[:start] + "\n".join(lines) + "\n" + text[end:], encoding="utf-8")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cbrun bench --workload speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,128", help="max_requests_per_batch values, comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)} (off first)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--repeats", type=int, default=3, help="round-robin repeats; rows give the medians")
    p.add_argument("--model-dir", type=Path, help="stories260K converted to transformers (built when empty)")
    p.add_argument("--draft-model", type=Path, help="draft model of the draft mode (default: the target itself)")
    p.add_argument("--shared", type=Path, help="the shared data folder (see cbrun.bench.workloads)")
    p.add_argument("--out", type=Path, help="write the Markdown report here (e.g. benchmarks/results-speculative.md)")
    p.add_argument("--readme", type=Path, help=f"rewrite the table between {README_START} and {README_END} here")
    p.add_argument("--json", type=Path, help="also write the rows as JSON to this path")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an EngineConfig setting for every run, e.g. speculative_row_cost=0.03 (repeatable)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    args.workloads = [w for w in args.workloads.split(",") if w]
    try:
        args.settings = parse_settings(args.engine)
    except ValueError as e:
        parser.error(str(e))
    if args.modes[0] != "off" or set(args.modes) - set(MODES) or set(args.workloads) - set(WORKLOADS):
        parser.error(f"--modes must start with off and come from {MODES}; --workloads from {WORKLOADS}")
    torch.set_num_threads(1)
    from cbrun.bench.backends import quiet_transformers, warm_up

    quiet_transformers()
    warm_up()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cbrun-spec-bench-") as scratch:
        model_dir = args.model_dir or Path(scratch) / "stories260k"
        runs, unavailable = run_all(args, model_dir, Path(scratch))
    rows = summarize(runs, unavailable, args)
    report = format_report(rows, args, argv, load_start, os.getloadavg())
    print(report)
    if args.out:
        args.out.write_text(report, encoding="utf-8")
    if args.readme:
        write_readme_table(args.readme, rows)
    if args.json:
        args.json.write_text(
            json.dumps(dict(date=datetime.datetime.now().isoformat(), rows=rows), indent=2) + "\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
