"""Every GPU check in one run: the Triton kernels against their reference and timed, then the engine's modes.

From a plain checkout on a CUDA machine (Python 3.12, torch with CUDA, triton, transformers; no extras)::

    PYTHONPATH=. python -m benchmarks.gpu_suite                     # writes benchmarks/results-gpu-suite.md
    PYTHONPATH=. python -m benchmarks.gpu_suite --results /tmp/r.md

It runs ``cbrun.kernels.gpu_check`` (attention in realistic batches, the decode tile in bf16 and float32 at head_dim 128
and 256 against the HBM roofline, the KV-cache write), ``cbrun.kernels.gpu_check_quantized`` (the int4, FP8 and MXFP4
GEMMs and FP8 W8A8 against dequantize-then-matmul, timed against the dense bf16 GEMM), ``cbrun.kernels.gpu_check_fused_moe``
(the fused MoE kernel on Qwen3-30B-A3B's and gpt-oss-20b's expert shapes, dense and quantized experts, against its
reference and the roofline) and ``benchmarks.gpu_engine_check`` (CUDA graphs, async
batching and swap preemption against the plain engine, token for token, then timed) and the grammar's masked
argmax against the CPU kernel (``benchmarks.structured_mask.device_check``) and the batch-invariant kernels (a row's
bits alone and in batches, decode against prefill, the invariant matmul's time against cuBLAS:
``benchmarks.batch_invariant_gpu_check``), prints one table and
writes it, with the device and versions, to the results file. A part that raises is a row saying so, and the
others still run. It takes about 2 to 4 minutes on an H100 (budget: under 8).

Exit status: 0 every check matched, 1 any mismatch or error, 2 without CUDA (nothing was run, nothing written).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results-gpu-suite.md"
HEADER = ["part", "check", "dtype", "case", "tile", "ok", "result", "roofline"]
NO_CUDA_EXIT = 2


def kernel_rows(copy_bandwidth_and_matmul: tuple[float, float]) -> list[tuple[list[str], bool]]:
    """The kernel checks as suite rows: (cells, ok)."""
    from cbrun.kernels import gpu_check

    rows = gpu_check.run_checks("cuda", gpu_check.cuda_bench, ceilings=copy_bandwidth_and_matmul)
    out = []
    for row in rows:
        c = row.cells()  # kernel, dtype, shape, tile, max err, ok, ms, GB/s, TFLOP/s, roofline
        result = f"{c[6]} ms, {c[7]} GB/s" + (f", {c[8]} TFLOP/s" if c[8] != "-" else "") + f", err {c[4]}"
        out.append((["kernels", c[0], c[1], c[2], c[3], c[5], result, c[9]], row.ok))
    return out


def quantized_rows(copy_bandwidth_and_matmul: tuple[float, float]) -> list[tuple[list[str], bool]]:
    """The quantized GEMMs (``cbrun.kernels.gpu_check_quantized``: int4, FP8, MXFP4 and W8A8 against the dense
    bf16 GEMM) as suite rows: (cells, ok)."""
    from cbrun.kernels import gpu_check, gpu_check_quantized

    rows = gpu_check_quantized.run_checks("cuda", gpu_check.cuda_bench, ceilings=copy_bandwidth_and_matmul)
    out = []
    for row in rows:
        c = row.cells()
        result = f"{c[6]} ms, {c[7]} GB/s" + (f", {c[8]} TFLOP/s" if c[8] != "-" else "") + f", err {c[4]}"
        out.append((["quantized", c[0], c[1], c[2], c[3], c[5], result, c[9]], row.ok))
    return out


def fused_moe_rows(copy_bandwidth_and_matmul: tuple[float, float]) -> list[tuple[list[str], bool]]:
    """The fused MoE kernel (``cbrun.kernels.gpu_check_fused_moe``: Qwen3-30B-A3B's and gpt-oss-20b's expert shapes,
    dense, FP8, int4 and MXFP4 experts, against the reference and bf16 experts through ``torch._grouped_mm``) as
    suite rows: (cells, ok)."""
    from cbrun.kernels import gpu_check, gpu_check_fused_moe

    rows = gpu_check_fused_moe.run_checks("cuda", gpu_check.cuda_bench, ceilings=copy_bandwidth_and_matmul)
    out = []
    for row in rows:
        c = row.cells()
        result = f"{c[6]} ms, {c[7]} GB/s, err {c[4]}"
        out.append((["fused_moe", c[0], c[1], c[2], c[3], c[5], result, c[9]], row.ok))
    return out


def engine_rows(copy_bandwidth: float) -> list[tuple[list[str], bool]]:
    """The engine checks as suite rows: (cells, ok)."""
    from benchmarks import gpu_engine_check

    out = []
    for row in gpu_engine_check.engine_checks(copy_bandwidth):
        c = row.cells()  # part, mode, dtype, tokens/s, vs plain, == plain, swaps, BW frac, ok
        result = f"{c[3]} tok/s, {c[4]} plain, {c[5]} equal" + (f", {c[6]} swaps" if row.offloads else "")
        out.append((["engine", f"{c[0]}: {c[1]}", c[2], "0.35B Llama", "-", c[8], result, c[7]], row.ok))
    return out


def batch_invariance_rows() -> list[tuple[list[str], bool]]:
    """The batch-invariant kernels compiled: rows alone and in batches, decode and prefill, the matmul's cost
    (``benchmarks.batch_invariant_gpu_check``)."""
    from benchmarks import batch_invariant_gpu_check
    from cbrun.kernels import gpu_check

    return batch_invariant_gpu_check.invariance_rows("cuda", gpu_check.cuda_bench)


def structured_rows() -> list[tuple[list[str], bool]]:
    """The grammar's masked argmax on the GPU (``benchmarks.structured_mask.device_check``) as suite rows."""
    from benchmarks import structured_mask
    from cbrun.kernels import gpu_check

    out = []
    for dtype, ok, exact, ms in structured_mask.device_check("cuda", gpu_check.cuda_bench):
        case = "256 x 32000, JSON-like bitmasks"
        tokens = "== the CPU's" if exact else "ties broken elsewhere" if ok else "WRONG (not the largest allowed)"
        result = f"{ms:.3f} ms (with a copy of the rows), tokens {tokens}"
        out.append((["structured", "masked argmax", dtype, case, "-", "yes" if ok else "NO", result, "-"], ok))
    return out


def environment() -> str:
    """Device, driver-visible versions and the host, for the results file's header."""
    import triton

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return (
        f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}), "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
        f"Python {platform.python_version()}"
    )


def run_suite() -> tuple[list[tuple[list[str], bool]], float]:
    """All parts; a part that raises becomes a failed row. Returns (rows, seconds)."""
    from cbrun.kernels import gpu_check

    start = time.perf_counter()
    rows: list[tuple[list[str], bool]] = []
    try:
        ceilings = gpu_check.measure_ceilings("cuda", gpu_check.cuda_bench)
    except Exception:  # noqa: BLE001 - reported as a row, the suite goes on
        traceback.print_exc()
        rows.append((["ceilings", "measure", "-", "-", "-", "NO", "raised (see log)", "-"], False))
        ceilings = None
    parts = (
        ("kernels", lambda: kernel_rows(ceilings)),
        ("quantized", lambda: quantized_rows(ceilings)),
        ("fused_moe", lambda: fused_moe_rows(ceilings)),
        ("engine", lambda: engine_rows(ceilings[0])),
        ("structured", structured_rows),
        ("batch invariance", batch_invariance_rows),
    )
    for name, part in parts if ceilings else ():
        try:
            rows += part()
        except Exception:  # noqa: BLE001 - reported as a row, the suite goes on
            traceback.print_exc()
            rows.append(([name, "all", "-", "-", "-", "NO", "raised (see log)", "-"], False))
        torch.cuda.empty_cache()
    return rows, time.perf_counter() - start


def report(rows: list[tuple[list[str], bool]], seconds: float, env: str) -> str:
    """The results file's text: header, the one table, the verdict."""
    from cbrun.kernels.gpu_check import format_table

    failed = sum(not ok for _, ok in rows)
    verdict = "all checks matched" if not failed else f"{failed} check(s) FAILED"
    return (
        f"# GPU suite\n\n`PYTHONPATH=. python -m benchmarks.gpu_suite` on {env}; {seconds:.0f} s; {verdict}.\n\n"
        "roofline: kernels, the fraction of the measured copy bandwidth (memory-bound rows) or bf16 matmul "
        "rate (prefill rows); engine, the median fraction of copy bandwidth decode-only steps reach.\n\n"
        "```\n" + format_table(HEADER, [cells for cells, _ in rows]) + "\n```\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite", description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="where to write the table")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print(
            "gpu_suite: no CUDA device here (torch.cuda.is_available() is False), nothing was run; run it on a "
            "machine with an NVIDIA GPU and a CUDA build of torch. The CPU side is `pytest` (kernels in Triton's "
            "interpreter, ahead-of-time compilation for sm_80/89/90)."
        )
        return NO_CUDA_EXIT
    env = environment()
    print(f"gpu_suite on {env}")
    rows, seconds = run_suite()
    text = report(rows, seconds, env)
    print()
    print(text)
    args.results.write_text(text)
    print(f"gpu_suite: wrote {args.results}")
    return 0 if all(ok for _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
