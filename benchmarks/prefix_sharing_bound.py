"""Where workload 3's time goes, with prefix sharing and without: a per-step cost fit, and the ratios it allows.

Usage (from the repo root; about a minute on 2 cores; results in ``benchmarks/results-prefix-sharing-bound.md``):
    PYTHONPATH=. python -m benchmarks.prefix_sharing_bound [--repeats 2] [--page-size 16] [--out FILE]

The workload is ``cbrun bench --workload gsm8k-fewshot`` (stories260K, 512 GSM8K questions after one shared
exemplar, greedy, stop token 1), run as the bench's ``cbrun`` and ``cbrun-nosharing`` backends do (one thread, 128
requests / 512 tokens per step). Every step's wall time is recorded with its plan, and a least-squares fit splits
each run's time into

    step time = fixed + a * prefill tokens + d * decode rows + c * context tokens the decode rows read

(prefill tokens: rows computing more than one token; a decode row reads its whole context). The fit of the
median run by wall time gives each part's seconds over the run. What a speed-up of one part would do to the
ratio of the two runs follows from those parts: both runs call the same kernels, so a kernel made faster helps
both, and the ratio moves between "prefill free in both" and "decode free in both".
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cbrun.bench.workloads import build_workload
from cbrun.engine import EngineConfig, LLMEngine, SamplingParams


def run_steps(workload, sharing: bool, page_size: int) -> tuple[float, np.ndarray]:
    """(wall seconds, (steps, 4) array of step seconds, prefill tokens, decode rows, decode context tokens)."""
    config = EngineConfig(
        num_threads=1,
        page_size=page_size,
        allow_block_sharing=sharing,
        max_requests_per_batch=128,
        max_batch_tokens=512,
    )
    engine = LLMEngine.from_pretrained(str(workload.model_dir), config)
    for request_id, (prompt, limit) in enumerate(zip(workload.prompts, workload.max_new_tokens)):
        engine.add_request(
            request_id, prompt, SamplingParams(max_new_tokens=limit, stop_token_ids=workload.stop_token_ids)
        )
    schedule, rows, plans = engine.scheduler.schedule, [], []

    def recording_schedule():
        plan = schedule()
        plans.append(plan)
        return plan

    engine.scheduler.schedule = recording_schedule
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        plans.clear()
        step_start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - step_start
        for plan in plans:
            decodes = [e for e in plan.scheduled if e.num_tokens == 1]
            rows.append(
                (
                    seconds,
                    sum(e.num_tokens for e in plan.scheduled if e.num_tokens > 1),
                    len(decodes),
                    sum(e.start + 1 for e in decodes),
                )
            )
    return time.perf_counter() - start, np.array(rows, dtype=float)


def fit(steps: np.ndarray) -> dict[str, float]:
    """Seconds of each part over the run, from the least-squares fit of step times; plus the fit's R^2."""
    x = np.c_[np.ones(len(steps)), steps[:, 1:]]
    coef, *_ = np.linalg.lstsq(x, steps[:, 0], rcond=None)
    residual = steps[:, 0] - x @ coef
    total = steps[:, 0] - steps[:, 0].mean()
    parts = coef * x.sum(axis=0)
    return {
        "fixed": parts[0],
        "prefill": parts[1],
        "decode": parts[2] + parts[3],
        "r2": 1 - residual @ residual / (total @ total),
        "per_prefill_token_us": coef[1] * 1e6,
        "per_context_token_ns": coef[3] * 1e9,
        "prefill_tokens": steps[:, 1].sum(),
        "decode_rows": steps[:, 2].sum(),
        "steps": len(steps),
    }


def report(results: dict[bool, tuple[float, dict]], command: str, page_size: int) -> str:
    lines = [
        f"# Workload 3: where the time goes with and without prefix sharing ({page_size}-token pages)",
        "",
        f"`{command}`; one thread, 128 requests / 512 tokens per step; median run by wall time; "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}.",
        "",
        "| run | wall s | steps | prefill tokens | decode rows | fixed s | prefill s | decode s | "
        "us per prefill token | ns per context token read | fit R^2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sharing, (wall, parts) in results.items():
        lines.append(
            f"| {'sharing' if sharing else 'no sharing'} | {wall:.2f} | {parts['steps']} | "
            f"{parts['prefill_tokens']:.0f} | {parts['decode_rows']:.0f} | {parts['fixed']:.2f} | "
            f"{parts['prefill']:.2f} | {parts['decode']:.2f} | {parts['per_prefill_token_us']:.1f} | "
            f"{parts['per_context_token_ns']:.0f} | {parts['r2']:.3f} |"
        )
    (ws, s), (wn, n) = results[True], results[False]
    measured = wn / ws
    prefill_free = (n["fixed"] + n["decode"]) / (s["fixed"] + s["decode"])
    decode_free = (n["fixed"] + n["prefill"]) / (s["fixed"] + s["prefill"])
    lines += [
        "",
        f"Measured ratio (no sharing / sharing wall time): {measured:.2f}x. With the same kernels in both "
        f"runs, a faster prefill moves it toward {prefill_free:.2f}x (prefill free in both), a faster decode "
        f"toward {decode_free:.2f}x (decode free in both).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--model-dir", type=Path, default=None, help="a stories260K model directory to reuse")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results-prefix-sharing-bound.md"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    command = f"python -m benchmarks.prefix_sharing_bound {' '.join(argv if argv is not None else sys.argv[1:])}"
    with tempfile.TemporaryDirectory() as scratch:
        workload = build_workload("gsm8k-fewshot", args.rows, (16, 256), 0, args.model_dir, Path(scratch))
        runs: dict[bool, list[tuple[float, np.ndarray]]] = {True: [], False: []}
        for _ in range(args.repeats):  # round-robin
            for sharing in (True, False):
                runs[sharing].append(run_steps(workload, sharing, args.page_size))
    results = {}
    for sharing, repeats in runs.items():
        wall, steps = sorted(repeats, key=lambda r: r[0])[len(repeats) // 2]  # the median run (upper for 2)
        results[sharing] = (wall, fit(steps))
    text = report(results, command.strip(), args.page_size)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
