"""torch's GEMM (``F.linear``) against oneDNN's (``cbrun.engine.model.layers.linear.onednn_linear``) per weight shape, rows and
threads: the measurement behind ``cbrun.engine.model.layers.linear.ONEDNN_MIN_WEIGHT_ELEMENTS``.

Usage (from the repository root)::

    python -m benchmarks.cpu_linear [--threads 1,2] [--rows 8,64,256] [--repeats 3] [--out FILE.md]

Each cell is the median over ``--repeats`` round-robin rounds (torch, oneDNN, torch, oneDNN, ...) of the mean time
of one call over a timed loop after a warm-up; the ratio is torch's time over oneDNN's (above 1: oneDNN faster).
The shapes are the projections of the random 40M Llama of ``cbrun bench --workload random-llama-30m`` (hidden 512,
intermediate 1408, 4 of 8 heads for K/V, vocabulary 32000) and of smaller models, down to stories260K's (hidden 64).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from cbrun.engine.model.layers.linear import ONEDNN_MIN_WEIGHT_ELEMENTS, onednn_linear, select_linear

#: (in_features, out_features, what it is).
SHAPES = [
    (64, 64, "stories260K q/o"),
    (64, 512, "stories260K LM head"),
    (256, 256, "hidden 256"),
    (512, 256, "40M Llama k/v"),
    (512, 512, "40M Llama q/o"),
    (512, 1408, "40M Llama gate/up"),
    (1408, 512, "40M Llama down"),
    (512, 32000, "40M Llama LM head"),
    (1024, 1024, "hidden 1024"),
]


def time_call(fn, x: torch.Tensor, weight: torch.Tensor, min_seconds: float = 0.05) -> float:
    """Mean seconds of one ``fn(x, weight, None)`` call over a loop of at least ``min_seconds``."""
    for _ in range(3):
        fn(x, weight, None)
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls < 5:
        fn(x, weight, None)
        calls += 1
    return elapsed / calls


def measure(threads: list[int], rows: list[int], repeats: int) -> list[dict]:
    results = []
    for num_threads in threads:
        torch.set_num_threads(num_threads)
        for m in rows:
            for k, n, what in SHAPES:
                torch.manual_seed(0)
                x, weight = torch.randn(m, k), torch.randn(n, k)
                times = {"torch": [], "onednn": []}
                for _ in range(repeats):
                    times["torch"].append(time_call(F.linear, x, weight))
                    times["onednn"].append(time_call(onednn_linear, x, weight))
                t, o = statistics.median(times["torch"]), statistics.median(times["onednn"])
                auto = "onednn" if select_linear(weight, "auto") is onednn_linear else "torch"
                results.append(
                    dict(
                        threads=num_threads, rows=m, k=k, n=n, what=what, torch_us=1e6 * t, onednn_us=1e6 * o, auto=auto
                    )
                )
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| threads | rows | in x out | weight | torch us | oneDNN us | torch / oneDNN | auto picks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['threads']} | {r['rows']} | {r['k']} x {r['n']} | {r['what']} | {r['torch_us']:.1f} | "
            f"{r['onednn_us']:.1f} | {r['torch_us'] / r['onednn_us']:.2f}x | {r['auto']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    parser.add_argument("--rows", default="8,64,256", help="rows per call (tokens in a step), comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="round-robin rounds per cell; cells give medians")
    parser.add_argument("--out", help="also write the report (Markdown) here")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    results = measure(threads, rows, args.repeats)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    report = "\n".join(
        [
            "# Linear layers on the CPU: torch's GEMM against oneDNN's",
            "",
            f"`python -m benchmarks.cpu_linear --threads {args.threads} --rows {args.rows} --repeats {args.repeats}`; "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__}, float32, load average at the "
            f"end {load}. Median of {args.repeats} round-robin rounds per cell. `auto` is "
            f"`cbrun.engine.model.layers.linear.select_linear(weight, 'auto')`: oneDNN from {ONEDNN_MIN_WEIGHT_ELEMENTS} weight "
            f"elements.",
            "",
            table(results),
            "",
        ]
    )
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
