"""Quantized linears: bytes a decode step's GEMMs move per token, bf16 against FP8 block and int4 group 128, and
what cbrun's CPU path costs today.

Usage (from the repository root)::

    python -m benchmarks.quantized_gemm [--rows 1 16] [--time-shape 4096 4096] [--repeats 20]

For the projections of one decoder layer of Llama-3-8B (hidden 4096, intermediate 14336, 32 heads and 8 KV heads
of 128) each layout's weight is built at its real shape with cbrun's own types (``QuantizedWeight``: float8 values
with float32 128x128 block scales; ``Int4Weight``: 4-bit codes packed in int32, float32 scale and uint8 zero per
group of 128) and its resident bytes read from them (``nbytes``); a bf16 weight is ``2 * out * in``. A decode step
of ``M`` rows reads each weight once and its activations (``M * in`` bf16) and writes ``M * out`` bf16: bytes per
token = (weight bytes + activation bytes) / M. At small ``M`` that is the weight's bytes, the memory-bound roofline
of a GEMM that reads the quantized weight directly (dequantizing in its inner loop, as vLLM's Marlin / Machete and
Triton FP8 kernels do), so the ratio to bf16 is the speed-up such a kernel can reach on decode.

cbrun does not have that kernel: on every device its quantized GEMM dequantizes ``rows_per_chunk`` output rows at a
time into the compute dtype and calls the dense GEMM (``quantized_linear``), so it also writes and reads back each
dequantized chunk; the "cbrun chunked" column counts those bytes too (quantized read + dequantized write + read).
The last table times ``quantized_linear`` against ``F.linear`` on the CPU at one shape (float32, one thread).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from cbrun.engine.model.layers.quantization.base import quantized_linear
from cbrun.engine.model.layers.quantization.fp8 import QuantizedWeight
from cbrun.engine.model.layers.quantization.int4 import Int4Weight

#: (name, out_features, in_features) of one Llama-3-8B decoder layer.
LAYER = (
    ("q_proj", 4096, 4096),
    ("k_proj", 1024, 4096),
    ("v_proj", 1024, 4096),
    ("o_proj", 4096, 4096),
    ("gate_proj", 14336, 4096),
    ("up_proj", 14336, 4096),
    ("down_proj", 4096, 14336),
)
GROUP = 128


def fp8_weight(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    values = torch.randn(out_features, in_features).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-out_features // 128), -(-in_features // 128)) + 0.5
    return QuantizedWeight(values, scale, (128, 128), dtype)


def int4_weight(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> Int4Weight:
    groups = -(-in_features // GROUP)
    packed = torch.randint(-(2**31), 2**31 - 1, (out_features, -(-in_features // 8)), dtype=torch.int32)
    zeros = torch.randint(0, 16, (out_features, groups), dtype=torch.uint8)
    return Int4Weight(packed, zeros, torch.rand(out_features, groups) + 0.01, in_features, GROUP, dtype)


def layer_bytes(rows: int) -> dict[str, tuple[float, float]]:
    """{layout: (roofline bytes per token, cbrun chunked bytes per token)} over ``LAYER`` at ``rows`` rows."""
    totals = {"bf16": [0.0, 0.0], "fp8 block 128x128": [0.0, 0.0], "int4 group 128": [0.0, 0.0]}
    for _, out_features, in_features in LAYER:
        activations = 2 * rows * (in_features + out_features)
        dense = 2 * out_features * in_features
        totals["bf16"][0] += dense + activations
        totals["bf16"][1] += dense + activations
        for name, build in (("fp8 block 128x128", fp8_weight), ("int4 group 128", int4_weight)):
            held = build(out_features, in_features).nbytes
            totals[name][0] += held + activations
            totals[name][1] += held + 2 * dense + activations  # each chunk written in bf16, then read by the GEMM
    return {name: (a / rows, b / rows) for name, (a, b) in totals.items()}


def cpu_times(out_features: int, in_features: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of one (1, in) x weight product per layout on the CPU, float32, one thread."""
    torch.set_num_threads(1)
    x = torch.randn(1, in_features)
    dense = torch.randn(out_features, in_features)
    runs = {
        "F.linear float32": lambda: F.linear(x, dense),
        "quantized_linear fp8 block": (lambda w: lambda: quantized_linear(x, w, None))(
            fp8_weight(out_features, in_features, torch.float32)
        ),
        "quantized_linear int4 g128": (lambda w: lambda: quantized_linear(x, w, None))(
            int4_weight(out_features, in_features, torch.float32)
        ),
    }
    times = {}
    for name, run in runs.items():
        run()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
        times[name] = sorted(samples)[len(samples) // 2] * 1e3
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--time-shape", type=int, nargs=2, default=[4096, 4096])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print("| decode rows | layout | roofline MiB / token | gain vs bf16 | cbrun chunked MiB / token | vs bf16 |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        table = layer_bytes(rows)
        base = table["bf16"][0]
        for name, (roofline, chunked) in table.items():
            print(
                f"| {rows} | {name} | {roofline / 2**20:.2f} | {base / roofline:.2f}x | {chunked / 2**20:.2f} | "
                f"{base / chunked:.2f}x |"
            )
    out_features, in_features = args.time_shape
    print()
    print(f"| CPU, (1, {in_features}) x ({out_features}, {in_features}), 1 thread | median ms | vs F.linear |")
    print("|---|---|---|")
    times = cpu_times(out_features, in_features, args.repeats)
    for name, ms in times.items():
        print(f"| {name} | {ms:.2f} | {ms / times['F.linear float32']:.1f}x |")


if __name__ == "__main__":
    main()
