"""The flags-only ``cbrun run`` command against transformers' padded ``generate`` on the long-generation workload.

Usage (from the repository root)::

    python -m benchmarks.long_generation --tree before=/path/to/old/checkout --tree after=. --repeats 3 \
        --markdown benchmarks/results-defaults.md

The workload (issue 19, "fast by default"): the first ``--rows`` (256) GSM8K test questions on stories260K,
greedy, stop token 1, ``max_new_tokens = min(256, 512 - prompt)``: the command passes ``--max-new-tokens 256`` and
the engine stops each row at the model's 512-token length.

Runs, round-robin ``--repeats`` times, each in a fresh process:

- per ``--tree LABEL=PATH[;SECTION.KEY=VALUE...]``: the whole command
  ``python -m cbrun.jobs.cli run --model M --input Q --prompt-column question --output O --max-new-tokens 256`` run in
  PATH with ``PYTHONPATH=PATH`` (that checkout's code and defaults; the ``--set`` assignments after ``;`` if any),
  timed from process start to exit. Its generation-phase tokens/s and peak memory come from the job's stats.json.
- ``hf-generate``: transformers ``generate`` on left-padded static batches of ``--batch-size`` (64) in input order,
  at torch's default thread count, timed over generation only (model loading excluded, which favours it).

A table row is a run's median repeat by time; "vs generate" divides generated tok/s by hf-generate's median
generation tok/s. CPU s (user + system, all threads) is steadier than wall time on a shared machine: cbrun's is the
whole command's, hf-generate's its generation's. Every run's outputs are compared with hf-generate's, token for token (cut at the first stop
token and at each row's limit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 256
CONTEXT = 512


def prepare(scratch: Path, rows: int) -> tuple[Path, Path]:
    """(stories260K converted to a transformers directory, a Parquet file of the first ``rows`` questions)."""
    import pyarrow.parquet as pq

    from cbrun.bench.workloads import gsm8k_path, stories260k_path
    from cbrun.jobs.model.convert_llama2c import convert_llama2c

    source = stories260k_path()
    model_dir = convert_llama2c(source / "stories260K.bin", source / "tok512.bin", scratch / "stories260K")
    questions = scratch / "questions.parquet"
    pq.write_table(pq.read_table(gsm8k_path("test"), columns=["question"]).slice(0, rows), questions)
    return model_dir, questions


def run_cbrun(tree: str, sets: list[str], model_dir: Path, questions: Path, scratch: Path) -> dict:
    """The whole flags-only command in a fresh process with ``PYTHONPATH=tree``."""
    out = scratch / f"out-{time.monotonic_ns()}"
    from cbrun.bench.command_backend import run_command_line

    command = run_command_line(model_dir, questions, out, MAX_NEW_TOKENS, ("--prompt-column", "question"), sets)
    tree = Path(tree).resolve()
    cpu_start = _children_cpu_s()
    start = time.perf_counter()
    # cwd too: ``python -m`` puts the working directory first on sys.path.
    done = subprocess.run(
        command, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    cpu = _children_cpu_s() - cpu_start
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{done.stderr[-2000:]}")
    # cbrun keeps stats.json in OUT/_cbrun/; checkouts older than that wrote it at the top.
    stats_path = next(p for p in (out / "_cbrun" / "stats.json", out / "stats.json") if p.is_file())
    stats = json.loads(stats_path.read_text())
    import pyarrow.parquet as pq

    table = pq.read_table(sorted(out.glob("part-*.parquet"))).sort_by("row_index")
    outputs = table.column("completion_token_ids").to_pylist()
    log = [line for line in done.stderr.splitlines() if "num_threads" in line or "KV cache" in line]
    return dict(
        whole_s=wall,
        cpu_s=cpu,
        generation_s=stats["generation_s"],
        generated=stats["num_generated_tokens"],
        peak_mib=stats.get("peak_memory_mib"),
        outputs=outputs,
        summary=done.stdout.strip(),
        log=log,
    )


def _children_cpu_s() -> float:
    """User plus system CPU seconds of this process's finished children (all their threads)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_hf(model_dir: Path, questions: Path, batch_size: int) -> dict:
    """transformers' padded generate in a fresh process (this checkout's code), torch's default threads."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.long_generation",
        "--hf-child",
        str(model_dir),
        str(questions),
        str(batch_size),
    ]
    done = subprocess.run(
        command, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"hf-generate failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def hf_child(model_dir: str, questions: str, batch_size: int) -> None:
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer

    from cbrun.bench.backends import _hf_generate_batch, _load_hf_model
    from cbrun.bench.workloads import cut_output

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = tokenizer(pq.read_table(questions).column("question").to_pylist())["input_ids"]
    limits = [min(MAX_NEW_TOKENS, CONTEXT - len(p)) for p in prompts]
    model = _load_hf_model(Path(model_dir))
    outputs = []
    cpu_start, start = time.process_time(), time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        rows = slice(first, first + batch_size)
        generated, _, _ = _hf_generate_batch(model, prompts[rows], limits[rows], (1,))
        outputs += [cut_output(g, limit, (1,)) for g, limit in zip(generated, limits[rows])]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(
        json.dumps(
            dict(
                generation_s=wall,
                generation_cpu_s=cpu,
                generated=sum(map(len, outputs)),
                threads=torch.get_num_threads(),
                outputs=outputs,
            )
        )
    )


def median_run(runs: list[dict], key: str) -> dict:
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[(len(ordered) - 1) // 2]


def report(results: dict[str, list[dict]], args, machine: str) -> str:
    hf = median_run(results["hf-generate"], "generation_s")
    hf_tps = hf["generated"] / hf["generation_s"]
    reference = hf["outputs"]
    lines = [
        "# The flags-only command vs transformers' padded generate (long-generation workload)",
        "",
        f"{args.rows} GSM8K test questions, stories260K, greedy, stop token 1, max_new_tokens = min(256, 512 - "
        f"prompt). {machine}. Median of {args.repeats} round-robin repeats (each in a fresh process); "
        f"min-max in brackets. Command: `{shlex.join(['python', '-m', 'benchmarks.long_generation', *sys.argv[1:]])}`.",
        "",
        "| run | whole command s | generation s | generated tokens | whole-command tok/s | generation tok/s "
        "| vs generate (whole command) | CPU s | gen tok per CPU s | peak RSS MiB | outputs == generate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in results.items():
        if label == "hf-generate":
            continue
        r = median_run(runs, "whole_s")
        whole = [x["generated"] / x["whole_s"] for x in runs]
        equal = sum(a == b for a, b in zip(r["outputs"], reference))
        lines.append(
            f"| cbrun {label} | {r['whole_s']:.1f} | {r['generation_s']:.1f} | {r['generated']} | "
            f"{r['generated'] / r['whole_s']:.0f} [{min(whole):.0f}-{max(whole):.0f}] | "
            f"{r['generated'] / r['generation_s']:.0f} | {r['generated'] / r['whole_s'] / hf_tps:.2f}x | "
            f"{r['cpu_s']:.1f} (whole command) | {r['generated'] / r['cpu_s']:.0f} | {r['peak_mib']:.0f} | "
            f"{equal}/{len(reference)} |"
        )
    spread = [x["generated"] / x["generation_s"] for x in results["hf-generate"]]
    lines.append(
        f"| hf-generate batch {args.batch_size}, {hf['threads']} threads (torch default) | n/a | "
        f"{hf['generation_s']:.1f} | {hf['generated']} | n/a | {hf_tps:.0f} [{min(spread):.0f}-"
        f"{max(spread):.0f}] | 1.00x (generation) | {hf['generation_cpu_s']:.1f} (generation) | "
        f"{hf['generated'] / hf['generation_cpu_s']:.0f} | n/a | reference |"
    )
    lines += ["", "Engine log lines of the median runs (thread choice, cache size):", ""]
    for label, runs in results.items():
        if label != "hf-generate":
            r = median_run(runs, "whole_s")
            lines += [f"- {label}: `{r['summary']}`"] + [f"  - `{line}`" for line in r["log"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--hf-child"]:
        hf_child(argv[1], argv[2], int(argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, metavar="LABEL=PATH[;SECTION.KEY=VALUE...]")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--markdown", type=Path, help="write the table to this file too")
    p.add_argument("--no-hf", action="store_true", help="leave out hf-generate (outputs are then not compared)")
    args = p.parse_args(argv)
    trees = {}
    for spec in args.tree:
        label, _, rest = spec.partition("=")
        path, *sets = rest.split(";")
        trees[label] = (path, sets)
    results: dict[str, list[dict]] = {label: [] for label in trees}
    if not args.no_hf:
        results["hf-generate"] = []
    with tempfile.TemporaryDirectory(prefix="cbrun-longgen-") as tmp:
        scratch = Path(tmp)
        model_dir, questions = prepare(scratch, args.rows)
        for repeat in range(args.repeats):
            for label, (path, sets) in trees.items():
                r = run_cbrun(path, sets, model_dir, questions, scratch)
                results[label].append(r)
                print(
                    f"[{repeat + 1}] {label}: {r['generated'] / r['whole_s']:.0f} tok/s whole command, "
                    f"{r['generated'] / r['generation_s']:.0f} generation, {r['generated'] / r['cpu_s']:.0f} per "
                    f"CPU s; load {os.getloadavg()[0]:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
            if not args.no_hf:
                r = run_hf(model_dir, questions, args.batch_size)
                results["hf-generate"].append(r)
                print(
                    f"[{repeat + 1}] hf-generate: {r['generated'] / r['generation_s']:.0f} tok/s generation; "
                    f"load {os.getloadavg()[0]:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    if args.no_hf:
        for label, runs in results.items():
            r = median_run(runs, "whole_s")
            print(
                f"{label}: {r['generated'] / r['whole_s']:.0f} tok/s whole, "
                f"{r['generated'] / r['generation_s']:.0f} generation, {r['generated'] / r['cpu_s']:.0f} per CPU s, "
                f"peak {r['peak_mib']:.0f} MiB"
            )
        return 0
    from cbrun.bench.measure import machine_info

    m = machine_info(0)
    text = report(
        results,
        args,
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, commit {m['commit']}, {datetime.date.today()}",
    )
    print(text)
    if args.markdown:
        args.markdown.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
