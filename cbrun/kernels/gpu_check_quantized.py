"""GPU check of the quantized GEMMs (``int4_gemm``, ``fp8_gemm``, ``mxfp4_gemm``, and the opt-in FP8 W8A8
``torch._scaled_mm``): correctness against dequantize-then-matmul and speed against the dense bf16 GEMM and the
measured copy bandwidth.

Run on a CUDA machine with ``python -m cbrun.kernels.gpu_check_quantized``: exit 0 when every kernel matches its
reference, 1 on a mismatch, 2 without CUDA (nothing checked; the CPU tests are ``tests/kernels/
test_quantized_gemm.py`` and ``test_quantized_matmul.py``, in Triton's interpreter). One table, as
``cbrun.kernels.gpu_check``'s::

    kernel | dtype | shape | tile | max err | ok | ms | GB/s | TFLOP/s | roofline

``shape`` is M x N x K; ``tile`` the launch the wrapper makes here (``gemm_launch.gemm_launch_config``); ``max err``
is relative to the largest |reference| value (the reference: the weight dequantized in float32, rounded to bf16,
``F.linear`` in float32). Up to 16 rows a launch is memory bound: ``GB/s`` counts the stored weight once per row
tile plus the activations, and ``roofline`` is that rate over the measured copy bandwidth; above, ``roofline`` is
the FLOP rate over the measured bf16 matmul rate. The ``bf16 F.linear`` rows time the dense GEMM (cuBLAS) on the
same shapes: the speed-up of a quantized kernel is their ``ms`` over its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cbrun.kernels.gpu_check import Row, check_main, measure_ceilings, print_table
from cbrun.kernels.quantized_matmul import Fp8Layout, Int4Layout, Mxfp4Layout, QuantizedLayout, quantized_matmul
from cbrun.kernels.quantized_reference import fp8_dequant_ref, int4_dequant_ref, mxfp4_dequant_ref

#: (N, K): Llama-3-8B's q/o, gate/up and down projections, gpt-oss-20b's expert gate_up.
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (5760, 2880))
#: Decode, a decode batch, a prefill-sized batch.
ROWS = (1, 16, 256)
#: Largest |error| relative to the largest |reference| value, bf16 (a few units in the last place).
TOLERANCE = 1.6e-2
#: Relative error allowed for W8A8 (its activations are rounded to float8) against the weight-only reference.
W8A8_TOLERANCE = 0.08


def make_layouts(n: int, k: int, device: str, seed: int = 0) -> dict[str, tuple[QuantizedLayout, torch.Tensor]]:
    """{kernel name: (layout, its real weight in float32)} at (n, k) on ``device``."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // 128)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=g) * 0.02
    qweight = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
    block_scale = torch.rand(-(-n // 128), groups, generator=g) * 0.002
    channel_scale = torch.rand(n, 1, generator=g) * 0.002
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8)
    e8m0 = torch.randint(118, 124, (n, k // 32), generator=g, dtype=torch.uint8)
    f32 = torch.float32
    moved = [t.to(device) for t in (packed, zeros, scales, qweight, block_scale, channel_scale, blocks, e8m0)]
    packed, zeros, scales, qweight, block_scale, channel_scale, blocks, e8m0 = moved
    return {
        "int4_gemm g128": (Int4Layout(packed, zeros, scales, k, 128), int4_dequant_ref(packed, zeros, scales, k, 128, f32)),
        "fp8_gemm block128": (Fp8Layout(qweight, block_scale, (128, 128)), fp8_dequant_ref(qweight, block_scale, (128, 128), f32)),
        "fp8_gemm channel": (Fp8Layout(qweight, channel_scale, (1, k)), fp8_dequant_ref(qweight, channel_scale, (1, k), f32)),
        "mxfp4_gemm": (Mxfp4Layout(blocks, e8m0), mxfp4_dequant_ref(blocks, e8m0, f32)),
    }  # fmt: skip


def stored_bytes(layout: QuantizedLayout) -> int:
    """Bytes the layout's tensors hold."""
    if isinstance(layout, Int4Layout):
        return layout.packed.nbytes + layout.zeros.nbytes + layout.scales.nbytes
    if isinstance(layout, Fp8Layout):
        return layout.qweight.nbytes + layout.scale.nbytes
    return layout.blocks.nbytes + layout.scales.nbytes


def _tile(layout: QuantizedLayout, x: torch.Tensor) -> tuple[str, int]:
    """(the launch's tile as text, its row tiles)."""
    from cbrun.kernels.fp8_gemm import fp8_block_k_cap
    from cbrun.kernels.gemm_launch import launch_config_for
    from cbrun.kernels.int4_gemm import int4_block_k_cap
    from cbrun.kernels.mxfp4_gemm import MXFP4_BLOCK_K_CAP

    k = x.shape[1]
    if isinstance(layout, Int4Layout):
        cap = int4_block_k_cap(layout.group_size, k)
    elif isinstance(layout, Fp8Layout):
        cap = fp8_block_k_cap(layout.block, k)
    else:
        cap = MXFP4_BLOCK_K_CAP
    config = launch_config_for(x, cap, False)
    c = config.constexprs
    return f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{config.num_warps}", -(-x.shape[0] // c["BLOCK_M"])


def _row(
    kernel: str, shape: str, tile: str, err: float, tol: float, ms: float, rows: int, n: int, k: int, weight: int,
    ceilings: tuple[float, float],
) -> Row:  # fmt: skip
    memory_bound = rows <= 16
    moved = weight + 2 * rows * (n + k)
    flops = 0.0 if memory_bound else 2.0 * rows * n * k
    return Row(kernel, "bfloat16", shape, tile, err, err <= tol, ms, moved, flops, ceilings[0 if memory_bound else 1])


def check_shape(
    n: int, k: int, rows: int, device: str, bench: Callable, ceilings: tuple[float, float], w8a8: bool
) -> list[Row]:
    """The dense bf16 GEMM and each quantized kernel at one (rows, n, k), against the reference."""
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=g).to(device=device, dtype=torch.bfloat16)
    shape = f"{rows}x{n}x{k}"
    dense = torch.randn(n, k, generator=g).to(device=device, dtype=torch.bfloat16)
    out = [_row("bf16 F.linear", shape, "cuBLAS", 0.0, 0.0, bench(lambda: F.linear(x, dense)), rows, n, k,
                dense.nbytes, ceilings)]  # fmt: skip
    for name, (layout, real) in make_layouts(n, k, device).items():
        want = F.linear(x.float(), real.to(torch.bfloat16).float())
        got = quantized_matmul(x, layout, backend="triton")
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        tile, row_tiles = _tile(layout, x)
        ms = bench(lambda layout=layout: quantized_matmul(x, layout, backend="triton"))
        out.append(_row(name, shape, tile, err, TOLERANCE, ms, rows, n, k, row_tiles * stored_bytes(layout), ceilings))
        if w8a8 and name == "fp8_gemm channel":
            got = quantized_matmul(x, layout, fp8_activation_scheme="dynamic")
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            ms = bench(lambda layout=layout: quantized_matmul(x, layout, fp8_activation_scheme="dynamic"))
            out.append(_row("fp8 W8A8 _scaled_mm", shape, "torch", err, W8A8_TOLERANCE, ms, rows, n, k,
                            stored_bytes(layout), ceilings))  # fmt: skip
    return out


def run_checks(
    device: str,
    bench: Callable,
    shapes=SHAPES,
    rows=ROWS,
    ceilings: tuple[float, float] | None = None,
    w8a8: bool | None = None,
) -> list[Row]:
    """Every quantized GEMM at ``shapes`` x ``rows`` on ``device``, timed with ``bench(fn) -> ms``; prints the
    table. ``w8a8``: also the ``torch._scaled_mm`` path (default: where the part has FP8, sm_89+)."""
    if ceilings is None:
        ceilings = measure_ceilings(device, bench)
    if w8a8 is None:
        w8a8 = device.startswith("cuda") and torch.cuda.get_device_capability() >= (8, 9)
    print(f"ceilings: copy {ceilings[0] / 1e9:.0f} GB/s (read + write), bf16 matmul {ceilings[1] / 1e12:.0f} TFLOP/s")
    table = [row for n, k in shapes for m in rows for row in check_shape(n, k, m, device, bench, ceilings, w8a8)]
    print_table(table)
    return table


def main() -> int:
    """Check and time the quantized GEMMs on the current CUDA device: 0 correct, 1 a mismatch, 2 without CUDA."""
    return check_main(
        "gpu_check_quantized", "tests/kernels/test_quantized_gemm.py and test_quantized_matmul.py", run_checks
    )


if __name__ == "__main__":
    sys.exit(main())
