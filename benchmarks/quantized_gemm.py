"""Quantized linears: bytes the Triton GEMMs move per decoded token, from their own launch configurations, against
the bf16 GEMM's; and what the CPU path costs.

Usage (from the repository root)::

    python -m benchmarks.quantized_gemm [--rows 1 16 64 256] [--capability 90] [--time-shape 4096 4096] [--moe]

Shapes: the seven projections of one Llama-3-8B decoder layer (hidden 4096, intermediate 14336, 32 heads and 8 KV
heads of 128) for bf16, FP8 128 x 128 blocks, FP8 per-channel and int4 group 128; one gpt-oss-20b expert (hidden
2880, intermediate 2880: gate_up (5760, 2880), down (2880, 2880)) for bf16 and MXFP4. Each quantized weight is
built at its real shape in the layout the kernels read (``cbrun.kernels.quantized_matmul``'s ``Int4Layout``,
``Fp8Layout``, ``Mxfp4Layout``), so its bytes are the tensors' ``nbytes`` (codes, scales, zero points).

Bytes of one launch, from ``gemm_launch.gemm_launch_config`` (the config the wrappers launch with) at ``M`` rows:
the grid has ``cdiv(M, BLOCK_M)`` row tiles and each row tile's programs stream the whole stored weight once, so
the weight moves ``row tiles x weight bytes``; x (``M * K``) is read from memory once (its re-reads by the
``cdiv(N, BLOCK_N)`` programs of a row tile hit L2) and the output (``M * N``) written once, both bf16. The bf16
GEMM is counted with the same tile policy over a dense ``2 * N * K`` weight. Per token: divided by ``M``. On
decode this is the memory-bound roofline such a launch reaches: the ratio to bf16 is the speed-up a GPU would see
(the issue's target: >= 1.8x for FP8, >= 3x for int4). Nothing here runs on a GPU.

The MoE table (``--moe``) does the same for one MoE layer's experts (Qwen3-30B-A3B: hidden 2048, 128 experts of
width 768, 8 per token; gpt-oss-20b: hidden 2880, 32 experts of width 2880, 4 per token), with a seeded uniform
routing of ``M`` tokens. The fused kernel (``cbrun.kernels.fused_moe``): its tile map (``expert_tile_map``, the
kernel's own code) at the launch configuration's BLOCK_M gives the non-empty row tiles, each streaming its expert's
stored gate, up and down weights once; plus the activations (x gathered per pair, the intermediate written and read,
the float32 products written and summed). Against the path it replaces on CUDA, which dequantized the layer's
experts every forward: every expert's stored bytes read and its bf16 weights written once (a lower bound: the
stacking copies again), then the grouped GEMM reading the touched experts' bf16 weights; and against bf16 experts
through the grouped GEMM.

The last table times ``quantized_matmul``'s CPU path (C dequantization chunk by chunk, then ``F.linear``) against
a dense ``F.linear``, float32, one thread, one (1, K) row.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cbrun.kernels.quantized_matmul import (
    Fp8Layout,
    Int4Layout,
    Mxfp4Layout,
    QuantizedLayout,
    quantized_matmul,
)

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
#: One gpt-oss-20b expert (the MXFP4 weights): gate and up fused, then down.
EXPERT = (("gate_up_proj", 5760, 2880), ("down_proj", 2880, 2880))
GROUP = 128


def int4_layout(n: int, k: int) -> Int4Layout:
    groups = -(-k // GROUP)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, -(-k // 8)), dtype=torch.int32)
    zeros = torch.randint(0, 16, (n, groups), dtype=torch.uint8)
    return Int4Layout(packed, zeros, torch.rand(n, groups) + 0.01, k, GROUP)


def fp8_layout(n: int, k: int, per_channel: bool = False) -> Fp8Layout:
    values = torch.randn(n, k).to(torch.float8_e4m3fn)
    block = (1, k) if per_channel else (128, 128)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1])) * 0.01 + 0.001
    return Fp8Layout(values, scale, block)


def mxfp4_layout(n: int, k: int) -> Mxfp4Layout:
    blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8)
    return Mxfp4Layout(blocks, torch.randint(118, 126, (n, k // 32), dtype=torch.uint8))


def weight_bytes(layout: QuantizedLayout | None, n: int, k: int) -> int:
    """Stored bytes of a weight: a layout's tensors, or a dense bf16 one for None."""
    if layout is None:
        return 2 * n * k
    if isinstance(layout, Int4Layout):
        return layout.packed.nbytes + layout.zeros.nbytes + layout.scales.nbytes
    if isinstance(layout, Fp8Layout):
        return layout.qweight.nbytes + layout.scale.nbytes
    return layout.blocks.nbytes + layout.scales.nbytes


def block_k_cap(layout: QuantizedLayout | None, k: int) -> int:
    """The layout's K-step cap, as its wrapper computes it."""
    from cbrun.kernels.fp8_gemm import fp8_block_k_cap
    from cbrun.kernels.int4_gemm import int4_block_k_cap
    from cbrun.kernels.mxfp4_gemm import MXFP4_BLOCK_K_CAP

    if isinstance(layout, Int4Layout):
        return int4_block_k_cap(layout.group_size, k)
    if isinstance(layout, Fp8Layout):
        return fp8_block_k_cap(layout.block, k)
    return MXFP4_BLOCK_K_CAP


def launch_bytes(layout: QuantizedLayout | None, n: int, k: int, rows: int, capability: int) -> tuple[int, int]:
    """(bytes one launch moves, its row tiles) at ``rows`` rows, from the wrappers' launch configuration."""
    from cbrun.kernels.gemm_launch import gemm_launch_config

    config = gemm_launch_config(torch.bfloat16, rows, block_k_cap(layout, k), capability, False)
    row_tiles = -(-rows // config.constexprs["BLOCK_M"])
    return row_tiles * weight_bytes(layout, n, k) + 2 * rows * (k + n), row_tiles


def layouts() -> dict[str, tuple[tuple, Callable[[int, int], QuantizedLayout | None]]]:
    """{name: (shapes, builder)}: builder None-returning for the bf16 baselines."""
    return {
        "bf16 (Llama-3-8B layer)": (LAYER, lambda n, k: None),
        "fp8 block 128x128": (LAYER, fp8_layout),
        "fp8 per-channel": (LAYER, lambda n, k: fp8_layout(n, k, per_channel=True)),
        "int4 group 128": (LAYER, int4_layout),
        "bf16 (gpt-oss-20b expert)": (EXPERT, lambda n, k: None),
        "mxfp4": (EXPERT, mxfp4_layout),
    }


def bytes_table(rows_list: list[int], capability: int) -> list[tuple[int, str, float, float, int]]:
    """(rows, layout, MiB per token, gain over its bf16 baseline, row tiles) for each row count and layout."""
    built = {name: [(n, k, build(n, k)) for _, n, k in shapes] for name, (shapes, build) in layouts().items()}
    table = []
    for rows in rows_list:
        base = 0.0
        for name, weights in built.items():
            total, tiles = 0, 0
            for n, k, layout in weights:
                moved, tiles = launch_bytes(layout, n, k, rows, capability)
                total += moved
            per_token = total / rows
            base = per_token if name.startswith("bf16") else base
            table.append((rows, name, per_token / 2**20, base / per_token, tiles))
    return table


#: (name, hidden, expert width I, experts E, top_k, formats): the MoE layers of ``moe_bytes_table``.
MOE_LAYERS = (
    ("Qwen3-30B-A3B", 2048, 768, 128, 8, ("fp8 block 128x128", "int4 group 128")),
    ("gpt-oss-20b", 2880, 2880, 32, 4, ("mxfp4",)),
)


def moe_bytes_table(rows_list: list[int], capability: int, seed: int = 0) -> list[tuple]:
    """(layer, layout, rows, experts touched, row tiles, fused MiB / token, dequantize-per-layer MiB / token,
    bf16 grouped MiB / token) per MoE layer, quantized layout and row count (see the module docstring)."""
    from cbrun.kernels.fused_moe import expert_tile_map, fused_moe_launch_config

    builders = {
        "fp8 block 128x128": ("fp8", fp8_layout),
        "int4 group 128": ("int4", int4_layout),
        "mxfp4": ("mxfp4", mxfp4_layout),
    }
    table = []
    for name, hidden, width, experts, top_k, formats in MOE_LAYERS:
        dense_expert = 2 * 3 * width * hidden  # bf16 gate, up and down
        for layout_name in formats:
            fmt, build = builders[layout_name]
            gate, down = build(width, hidden), build(hidden, width)
            stored_expert = 2 * weight_bytes(gate, width, hidden) + weight_bytes(down, hidden, width)
            cap = min(block_k_cap(gate, hidden), block_k_cap(down, width))
            for rows in rows_list:
                g = torch.Generator().manual_seed(seed + rows)
                ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)])
                pairs = rows * top_k
                config = fused_moe_launch_config(
                    torch.bfloat16, pairs, experts, cap, capability, fmt, True, "silu", False, False
                )
                _, tile_map = expert_tile_map(ids, experts, config.constexprs["BLOCK_M"])
                tiles = int((tile_map[2] > tile_map[1]).sum())
                touched = int(ids.unique().numel())
                activations = pairs * (2 * hidden + 2 * 2 * width + 2 * 4 * hidden) + 2 * rows * hidden
                fused = tiles * stored_expert + activations
                per_layer = experts * (stored_expert + dense_expert) + touched * dense_expert + activations
                dense = touched * dense_expert + activations
                mib = [b / rows / 2**20 for b in (fused, per_layer, dense)]
                table.append((name, layout_name, rows, touched, tiles, *mib))
    return table


def cpu_times(n: int, k: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of one (1, k) x (n, k) product per layout on the CPU, float32, one thread."""
    torch.set_num_threads(1)
    x = torch.randn(1, k)
    dense = torch.randn(n, k)
    runs = {"F.linear float32": lambda: F.linear(x, dense)}
    for name, layout in (
        ("fp8 block 128x128", fp8_layout(n, k)),
        ("int4 group 128", int4_layout(n, k)),
        ("mxfp4", mxfp4_layout(n, k)),
    ):
        runs[f"quantized_matmul {name}"] = (lambda w: lambda: quantized_matmul(x, w))(layout)
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
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--capability", type=int, default=90, help="the GPU part whose tiles are used (80, 89, 90)")
    parser.add_argument("--time-shape", type=int, nargs=2, default=[4096, 4096])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--moe", action="store_true", help="also the MoE layers' table (fused_moe against dequantize-per-layer)"
    )
    args = parser.parse_args()
    print(f"Bytes per decoded token, sm_{args.capability} launch configurations (bf16 activations)")
    print()
    print("| rows | layout | row tiles | MiB / token | fewer bytes than bf16 |")
    print("|---|---|---|---|---|")
    for rows, name, mib, gain, tiles in bytes_table(args.rows, args.capability):
        print(f"| {rows} | {name} | {tiles} | {mib:.2f} | {gain:.2f}x |")
    if args.moe:
        print()
        print(f"MoE layer bytes per decoded token, sm_{args.capability} launch configurations (bf16 activations)")
        print()
        print(
            "| layer | layout | rows | experts touched | row tiles | fused kernel MiB / token | dequantize per layer "
            "MiB / token | fewer bytes | bf16 grouped GEMM MiB / token |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for name, layout, rows, touched, tiles, fused, per_layer, dense in moe_bytes_table(args.rows, args.capability):
            print(
                f"| {name} | {layout} | {rows} | {touched} | {tiles} | {fused:.2f} | {per_layer:.2f} | "
                f"{per_layer / fused:.1f}x | {dense:.2f} |"
            )
    n, k = args.time_shape
    print()
    print(f"| CPU, (1, {k}) x ({n}, {k}), float32, 1 thread | median ms | vs F.linear |")
    print("|---|---|---|")
    times = cpu_times(n, k, args.repeats)
    for name, ms in times.items():
        print(f"| {name} | {ms:.2f} | {ms / times['F.linear float32']:.1f}x |")


if __name__ == "__main__":
    main()
