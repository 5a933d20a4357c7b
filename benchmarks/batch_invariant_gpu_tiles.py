"""The GPU side of ``engine.batch_invariant``: the tiles its Triton kernels launch, their fit on each part, and
the arithmetic the fixed matmul tile pads on at each batch size. No GPU is needed (nothing here is a GPU timing).

Usage (from the repository root, without ``TRITON_INTERPRET``)::

    python -m benchmarks.batch_invariant_gpu_tiles [--capability 90 ...]
    python -m benchmarks.batch_invariant_gpu_tiles --from-json fits.json   # from ``aot_fit --json``: no compiling

Two tables:

* **tiles**: every launch of the invariant kernels for the models of ``cbrun.kernels.aot_fit.MODELS`` in bf16,
  fp16 and float32 (the matmul, RMSNorm, log-softmax, and paged attention's invariant tile), compiled ahead of
  time for sm_80, sm_89 and sm_90: shared memory, registers, spills (``cbrun.kernels.aot_fit``);
* **padding**: the matmul's one tile is ``BLOCK_M`` rows whatever M is, so a step of M rows computes
  ``ceil(M / BLOCK_M) * BLOCK_M`` rows of every projection; the factor over M is the upper bound of the invariant
  GEMM's extra arithmetic against a GEMM sized to M (a decode step is memory bound, where the weight is read once
  either way, so its time grows far less than this factor).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch


def _invariant_launches(capability: int) -> list:
    from cbrun.kernels import aot_fit

    kernels = {"batch_invariant_matmul", "rms_norm", "log_softmax"}
    launches = []
    for launch in aot_fit.wrapper_launches(windows=False, kv_write=False):
        c = launch.config.constexprs
        if c.get("DOT_IN_FP32"):
            continue  # the interpreter's launches: never on a GPU
        if launch.kernel in kernels:
            launches.append(launch)
    # Attention's invariant launch on this part: the prefill tile (paged_attention.INVARIANT_MAX_SEQLEN_Q).
    from cbrun.kernels.paged_attention import INVARIANT_MAX_SEQLEN_Q

    launches += [
        launch
        for launch in aot_fit.engine_launches(
            capability, max_seqlen_qs=(INVARIANT_MAX_SEQLEN_Q,), windows=False, kv_write=False
        )
    ]
    return launches


def padding_table(batch_sizes=(1, 8, 32, 64, 128, 256, 512)) -> list[str]:
    """Rows computed per row needed by the invariant matmul, per dtype and batch size."""
    from cbrun.kernels.tile_policy import pick_invariant_matmul_tile

    lines = ["| dtype | BLOCK_M x BLOCK_N x BLOCK_K | " + " | ".join(f"M={m}" for m in batch_sizes) + " |"]
    lines.append("|---|---|" + "---|" * len(batch_sizes))
    for dtype in (torch.bfloat16, torch.float32):
        tile = pick_invariant_matmul_tile(dtype.itemsize)
        factors = [math.ceil(m / tile.block_m) * tile.block_m / m for m in batch_sizes]
        lines.append(
            f"| {str(dtype).removeprefix('torch.')} | {tile.block_m} x {tile.block_n} x {tile.block_k} | "
            + " | ".join(f"{f:.2f}x" for f in factors)
            + " |"
        )
    return lines


def _invariant_attention_tiles() -> set[str]:
    """``format_fit``'s first four columns (arch, kernel, dtype, tile and warps) of attention's invariant launch
    (the tile ``INVARIANT_MAX_SEQLEN_Q`` picks) on each part, for every model and dtype of ``aot_fit``."""
    from cbrun.kernels import aot_fit
    from cbrun.kernels.paged_attention import INVARIANT_MAX_SEQLEN_Q

    prefixes = set()
    for capability in aot_fit.CAPABILITIES:
        for launch in aot_fit.engine_launches(
            capability, max_seqlen_qs=(INVARIANT_MAX_SEQLEN_Q,), windows=False, kv_write=False
        ):
            fit = aot_fit.Fit(launch, capability, 0, 0, 0)
            prefixes.add(" | ".join(aot_fit.format_fit(fit).split(" | ")[:4]))
    return prefixes


def _lines_from_json(path: Path) -> list[tuple[bool, str]]:
    """(fits, line) of the invariant kernels' launches in an ``aot_fit --json`` file: the matmul, RMSNorm and
    log-softmax launches a device makes (not the interpreter's upcast ones), and attention's invariant tile on each
    part (``_invariant_attention_tiles``)."""
    attention = _invariant_attention_tiles()
    found = []
    for fit in json.loads(path.read_text()):
        line = fit["line"]
        invariant = fit["kernel"] in ("batch_invariant_matmul", "rms_norm", "log_softmax") and " up " not in line
        invariant |= fit["kernel"] == "paged_attention" and " | ".join(line.split(" | ")[:4]) in attention
        if invariant:
            found.append((fit["ok"], line))
    return found


def main(argv: list[str] | None = None) -> int:
    from cbrun.kernels import aot_fit

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, action="append", choices=aot_fit.CAPABILITIES)
    parser.add_argument("--from-json", type=Path, help="read the fits from an aot_fit --json file instead")
    args = parser.parse_args(argv)
    print("arch | kernel | dtype | tile | shared | regs | stack | fits | first made by")
    bad = 0
    if args.from_json:
        for ok, line in _lines_from_json(args.from_json):
            bad += not ok
            print(line)
    for capability in [] if args.from_json else args.capability or aot_fit.CAPABILITIES:
        for launch in _invariant_launches(capability):
            fit = aot_fit.compile_launch(launch, capability)
            bad += not fit.ok
            print(aot_fit.format_fit(fit), flush=True)
    print()
    print("\n".join(padding_table()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
