"""The report of ``cbrun bench``: one record per run, the table of median runs, the header lines.

Repeats: the machine's speed drifts over minutes and backends run one after another, so ``--repeats N`` runs the
whole list of backend runs N times round-robin (b1, b2, ..., b1, b2, ...), each run in a process of its own (unless
``--no-isolate``). A table row is the backend's (and setting's) median run by wall time, with all its numbers from
that one run; of an even N, the faster of the two middle runs. "vs cbrun" divides those median runs' generated
tok/s; with N > 1 a column gives the min-max of generated tok/s over the repeats. The JSON keeps every run
(``runs``) beside the table's rows (``results``). hf-cb takes its block count from the first cbrun run.

Outputs are compared after cutting each row as cbrun does: at the first stop token (kept), and at the row's
``max_new_tokens`` (which the workload already caps at the model's maximum length). Every run, every repeat of
cbrun included, is compared with cbrun's first run (greedy decoding is deterministic); a row of the table names
each repeat that differs and in how many rows."""

from __future__ import annotations

import statistics

from cbrun.bench.measure import ModelCost, RunResult
from cbrun.bench.workloads import Workload


def summarize(
    result: RunResult, workload: Workload, reference: RunResult | None, cost: ModelCost, matmul_gflops: float
) -> dict:
    """The JSON record of one run (a table row when it is its backend's median run)."""
    generated = sum(len(o) for o in result.outputs)
    total = generated + workload.num_prompt_tokens
    ttft = [t for t in result.first_token_s if t is not None]
    itl = [
        (f - s) / (len(o) - 1)
        for s, f, o in zip(result.first_token_s, result.finish_s, result.outputs)
        if s is not None and f is not None and len(o) >= 2
    ]
    flops = cost.useful_flops(workload.prompts, result.outputs) / result.wall_s
    row = dict(
        backend=result.backend,
        setting=result.setting,
        repeat=result.repeat,
        rows=len(result.outputs),
        prompt_tokens=workload.num_prompt_tokens,
        generated_tokens=generated,
        wall_s=result.wall_s,
        cpu_s=result.cpu_s,
        generated_tok_s=generated / result.wall_s,
        total_tok_s=total / result.wall_s,
        # None when the run took less CPU time than its clock resolves (a subprocess's /proc times tick
        # at 10 ms): a short run on a fast machine can read 0.
        generated_tok_per_cpu_s=generated / result.cpu_s if result.cpu_s > 0 else None,
        computed_tokens=result.computed_tokens,
        cached_prompt_tokens=result.info.get("num_cached_prompt_tokens"),
        prefix_hit_rate=result.info.get("prefix_hit_rate"),
        ttft_s=_percentiles(ttft),
        itl_s=_percentiles(itl),
        rss_peak_mib=result.rss_peak_mib,
        rss_base_mib=result.rss_base_mib,
        useful_gflop_s=flops / 1e9,
        fraction_of_matmul_ceiling=flops / 1e9 / matmul_gflops,
        load_avg_before=result.load_avg[0],
        load_avg_after=result.load_avg[1],
        info=result.info,
    )
    row.update(compare_outputs(result.outputs, reference.outputs if reference else None))
    return row


def _percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def compare_outputs(outputs: list[list[int]], reference: list[list[int]] | None) -> dict:
    """How many rows equal the reference token for token; the first differing rows with their first bad index."""
    if reference is None:
        return {"rows_equal": None, "rows_differing": None, "first_differences": []}
    differing = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
    first = [
        {
            "row": i,
            "token": next(
                (k for k, (a, b) in enumerate(zip(outputs[i], reference[i])) if a != b),
                min(len(outputs[i]), len(reference[i])),
            ),
        }
        for i in differing[:10]
    ]
    return {"rows_equal": len(outputs) - len(differing), "rows_differing": len(differing), "first_differences": first}


def median_runs(runs: list[dict]) -> list[dict]:
    """Per backend and setting (in first-run order), its median run by wall time: the table's rows.

    With an even number of repeats the faster of the two middle runs is taken, so every number of a row comes from
    one real run. Each row also gets ``repeats`` (its number of runs), ``generated_tok_s_range`` ([min, max] over
    them) and ``repeats_differing`` (per run whose outputs differ from the reference: its repeat and rows differing).
    """
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["backend"], run["setting"]), []).append(run)
    rows = []
    for group in groups.values():
        by_wall = sorted(group, key=lambda run: run["wall_s"])
        speeds = [run["generated_tok_s"] for run in group]
        rows.append(
            {
                **by_wall[(len(group) - 1) // 2],
                "repeats": len(group),
                "generated_tok_s_range": [min(speeds), max(speeds)],
                "repeats_differing": [
                    {"repeat": run["repeat"], "rows_differing": run["rows_differing"]}
                    for run in group
                    if run["rows_differing"]
                ],
            }
        )
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Set each row's generated tokens/s relative to cbrun's (``vs_cbrun``)."""
    base = next((r["generated_tok_s"] for r in rows if r["backend"] == "cbrun"), None)
    for row in rows:
        row["vs_cbrun"] = row["generated_tok_s"] / base if base else None


TABLE_COLUMNS = (
    "backend",
    "rows",
    "prompt tok",
    "cached prompt tok (hit rate)",
    "gen tok",
    "wall s",
    "CPU s",
    "gen tok/s",
    "total tok/s",
    "vs cbrun",
    "TTFT p50/p99 s",
    "ITL p50/p99 ms",
    "peak RSS MiB (+ over base)",
    "useful GFLOP/s (% ceiling)",
    "outputs == cbrun",
)


def markdown_table(columns: list[str] | tuple[str, ...], rows: list[list]) -> str:
    """A Markdown table: a header of ``columns``, then one line per row of cells (each shown with ``str``)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in cells) + " |" for cells in rows]
    return "\n".join(lines)


#: The extra column when backends ran more than once, after "gen tok/s".
SPREAD_COLUMN = "gen tok/s min-max"


def format_table(rows: list[dict]) -> str:
    """A Markdown table with one row per backend and setting (its median run; see ``median_runs``)."""
    repeated = any(r["repeats"] > 1 for r in rows)
    columns = list(TABLE_COLUMNS)
    if repeated:
        columns.insert(columns.index("gen tok/s") + 1, SPREAD_COLUMN)
    table = []
    for r in rows:
        name = f"{r['backend']} ({r['setting']})" if r["setting"] else r["backend"]
        ttft = f"{r['ttft_s']['p50']:.2f} / {r['ttft_s']['p99']:.2f}" if r["ttft_s"] else "n/a"
        itl = f"{r['itl_s']['p50'] * 1e3:.1f} / {r['itl_s']['p99'] * 1e3:.1f}" if r["itl_s"] else "n/a"
        cells = [
            name,
            r["rows"],
            r["prompt_tokens"],
            _cached_cell(r),
            r["generated_tokens"],
            f"{r['wall_s']:.1f}",
            f"{r['cpu_s']:.1f}",
            f"{r['generated_tok_s']:.0f}",
            f"{r['total_tok_s']:.0f}",
            f"{r['vs_cbrun']:.2f}x" if r["vs_cbrun"] else "n/a",
            ttft,
            itl,
            _memory_cell(r),
            f"{r['useful_gflop_s']:.2f} ({100 * r['fraction_of_matmul_ceiling']:.1f}%)",
            _outputs_cell(r),
        ]
        if repeated:
            low, high = r["generated_tok_s_range"]
            cells.insert(columns.index(SPREAD_COLUMN), f"{low:.0f}-{high:.0f}")
        table.append(cells)
    return markdown_table(columns, table)


def _cached_cell(row: dict) -> str:
    if row["cached_prompt_tokens"] is None:
        return "n/a"
    return f"{row['cached_prompt_tokens']} ({100 * row['prefix_hit_rate']:.1f}%)"


def _outputs_cell(row: dict) -> str:
    """The "outputs == cbrun" cell: "reference", "yes (rows/rows)", or each repeat that differs and in how many rows."""
    if row["repeats_differing"]:
        differences = []
        for d in row["repeats_differing"]:
            where = f" in repeat {d['repeat']}" if row["repeats"] > 1 else ""
            differences.append(f"{d['rows_differing']}/{row['rows']} rows differ{where}")
        return "NO: " + "; ".join(differences)
    if row["backend"] == "cbrun":
        return f"reference (all {row['repeats']} repeats agree)" if row["repeats"] > 1 else "reference"
    every = f", all {row['repeats']} repeats" if row["repeats"] > 1 else ""
    return f"yes ({row['rows']}/{row['rows']}{every})"


def sharing_summary(rows: list[dict]) -> str | None:
    """One line on what prefix sharing buys: cbrun's cache hits and its speed against ``cbrun-nosharing``.

    Returns None unless both ran.
    """
    by_backend = {r["backend"]: r for r in rows if not r["setting"]}
    shared, unshared = by_backend.get("cbrun"), by_backend.get("cbrun-nosharing")
    if shared is None or unshared is None:
        return None
    return (
        f"prefix sharing: cbrun served {shared['cached_prompt_tokens']} of {shared['prompt_tokens']} prompt "
        f"tokens from its prefix cache ({100 * shared['prefix_hit_rate']:.1f}%) and ran "
        f"{shared['computed_tokens']} tokens through the model against {unshared['computed_tokens']} without "
        f"sharing; generated tok/s {shared['generated_tok_s'] / unshared['generated_tok_s']:.2f}x of "
        f"cbrun-nosharing's"
    )


def _memory_cell(row: dict) -> str:
    if row["rss_peak_mib"] is None:
        return "n/a"
    if row["rss_base_mib"] is None:  # cbrun-command: the job's own peak, no base
        return f"{row['rss_peak_mib']:.0f}"
    return f"{row['rss_peak_mib']:.0f} (+{row['rss_peak_mib'] - row['rss_base_mib']:.0f})"


#: The cbrun rows ``vllm_summary`` takes the best of: the tuned settings (the reference and each budget).
TUNED_CBRUN = ("cbrun", "cbrun-budgets")


def vllm_summary(rows: list[dict]) -> str | None:
    """One line on cbrun against vLLM's CPU backend: cbrun's best tuned row and its defaults, as ratios of vLLM's
    generated tok/s, and whether the best row's outputs equal vLLM's. None unless vllm ran."""
    vllm = next((r for r in rows if r["backend"] == "vllm"), None)
    tuned = [r for r in rows if r["backend"] in TUNED_CBRUN]
    if vllm is None or not tuned:
        return None
    best = max(tuned, key=lambda r: r["generated_tok_s"])
    name = f"{best['backend']} ({best['setting']})" if best["setting"] else f"{best['backend']} (reference)"
    equal = "rows equal to cbrun's: " + (
        f"{vllm['rows_equal']}/{vllm['rows']}" if vllm["rows_equal"] is not None else "n/a"
    )
    version = vllm["info"].get("versions", {}).get("vllm", "")
    line = (
        f"vs vLLM's CPU backend {version}: vLLM {vllm['generated_tok_s']:.0f} generated tok/s (engine start "
        f"{vllm['info'].get('init_s', 0):.1f} s, not in its wall time); cbrun's best, {name}, "
        f"{best['generated_tok_s']:.0f} = {best['generated_tok_s'] / vllm['generated_tok_s']:.2f}x"
    )
    defaults = next((r for r in rows if r["backend"] == "cbrun-defaults"), None)
    if defaults:
        line += (
            f"; cbrun-defaults {defaults['generated_tok_s']:.0f} = "
            f"{defaults['generated_tok_s'] / vllm['generated_tok_s']:.2f}x"
        )
    return line + f"; vLLM {equal}"


def command_summary(rows: list[dict]) -> str | None:
    """One line on the whole ``cbrun run`` command (defaults) against transformers' padded ``generate``: generated
    tokens over the command's whole time, as a ratio of each hf-generate row's. None unless both ran."""
    command = next((r for r in rows if r["backend"] == "cbrun-command"), None)
    generate = [r for r in rows if r["backend"] == "hf-generate"]
    if command is None or not generate:
        return None
    ratios = ", ".join(
        f"{command['generated_tok_s'] / r['generated_tok_s']:.2f}x hf-generate {r['setting']} at "
        f"{r['info'].get('threads', '?')} thread(s) ({r['generated_tok_s']:.0f} tok/s, generation only)"
        for r in generate
    )
    generation_s = command["info"].get("generation_s")
    phase = f", {command['generated_tokens'] / generation_s:.0f} over its generation phase" if generation_s else ""
    return (
        f"whole command (cbrun run, default settings, process start to exit): "
        f"{command['generated_tok_s']:.0f} generated tok/s{phase} = {ratios}{_command_split(command)}"
    )


def _command_split(command: dict) -> str:
    """Where the whole command's wall time went: generation, the job's setup and finish around it (run_job: reading
    the manifest, imports it triggers, loading, writing the summary), and the rest (interpreter start, imports
    before the job, exit); its peak RSS."""
    info = command["info"]
    generation_s, job_s = info.get("generation_s"), info.get("job_elapsed_s")
    if not generation_s or not job_s:
        return ""
    return (
        f"; its {command['wall_s']:.1f} s: generation {generation_s:.1f} s, job setup and finish "
        f"{job_s - generation_s:.1f} s, interpreter start, imports before the job and exit "
        f"{command['wall_s'] - job_s:.1f} s; peak RSS {command['rss_peak_mib']:.0f} MiB"
    )


def format_report(report: dict) -> str:
    """The header lines, the table, the backends skipped and why, and one line each on what prefix sharing bought,
    cbrun against vLLM, and the whole command against ``generate`` (when those backends ran)."""
    m = report["machine"]
    lines = [
        f"workload: {report['workload']}: {report['description']}",
        f"model parameters: {report['model_params'] / 1e6:.2f}M; fp32 matmul ceiling "
        f"{report['matmul_ceiling_gflop_s']:.1f} GFLOP/s at {m['torch_threads']} thread(s)",
        f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
        f"commit {m['commit']}, {m['date']}; "
        f"load average (1/5/15 min) at start {_load(report['load_avg_start'])}, end {_load(report['load_avg_end'])}",
        *_repeats_note(report["repeats"]),
        "",
        format_table(report["results"]),
    ]
    skipped = [f"- {s['backend']}: skipped: {s['reason']}" for s in report.get("skipped", [])]
    if skipped:
        lines += ["", *skipped]
    for summary in (sharing_summary, vllm_summary, command_summary):
        line = summary(report["results"])
        if line:
            lines += ["", line]
    return "\n".join(lines)


def _repeats_note(repeats: int) -> list[str]:
    if repeats == 1:
        return []
    even = " (of an even count, the faster middle run)" if repeats % 2 == 0 else ""
    return [
        f"each row: the backend's median run by wall time of {repeats} round-robin repeats{even}; ratios use "
        f"those runs; min-max: generated tok/s over the repeats; outputs compared with cbrun's first run"
    ]


def _load(values) -> str:
    return "/".join(f"{v:.2f}" for v in values)
