"""The batch-invariant kernels on a GPU, compiled: a row's bits alone and in batches, and the matmul's cost.

A part of ``python -m benchmarks.gpu_suite`` (which runs it on CUDA); ``invariance_rows`` takes the device and the
sizes, so its CPU test runs the same code in Triton's interpreter on tiny shapes
(``tests/benchmarks/test_batch_invariant_gpu_check.py``). Rows, in bf16:

* ``matmul rows``: ``batch_invariant_linear_triton`` on ``rows`` rows of a (features x features) weight, then on
  slices of 1, 3, 17, 128 and 129 rows at several offsets: every slice's output must equal the full call's rows
  bit for bit;
* ``rms_norm rows``: the same for ``rms_norm_triton``;
* ``attention decode = prefill``: one request's tokens attended as a whole prefill and each as a decode row
  (``batch_invariant=True``): equal bits;
* ``matmul time``: milliseconds of the invariant matmul against ``F.linear`` (cuBLAS) at 1, 8, 64 and 256 rows,
  the cost of the fixed tile (``bench`` given only).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Row = tuple[list[str], bool]
SLICES = (1, 3, 17, 128, 129)


def invariance_rows(
    device: str,
    bench: Callable[[Callable], float] | None = None,
    rows: int = 300,
    features: int = 4096,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 128,
    context: int = 300,
) -> list[Row]:
    """The checks as suite rows ``(cells, ok)``; cells as ``gpu_suite.HEADER``."""
    from cbrun.kernels.batch_invariant_matmul import batch_invariant_linear_triton, matmul_launch_config
    from cbrun.kernels.rms_norm import rms_norm_triton

    name = str(dtype).removeprefix("torch.")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, features, generator=generator).to(device=device, dtype=dtype)
    weight = (torch.randn(features, features, generator=generator) * features**-0.5).to(device=device, dtype=dtype)
    norm_weight = torch.randn(features, generator=generator).to(device=device, dtype=dtype)
    config = matmul_launch_config(dtype, False)
    c = config.constexprs
    tile = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w={config.num_warps}"
    out: list[Row] = []
    for label, fn in (
        ("matmul rows", lambda t: batch_invariant_linear_triton(t, weight)),
        ("rms_norm rows", lambda t: rms_norm_triton(t, norm_weight, 1e-6)),
    ):
        full = fn(x)
        bad = [
            (start, count)
            for count in SLICES
            if count <= rows
            for start in (0, (rows - count) // 2, rows - count)
            if not torch.equal(fn(x[start : start + count].clone()), full[start : start + count])
        ]
        cells = ["batch invariance", label, name, f"{rows} rows, slices {SLICES}", tile if "matmul" in label else "-"]
        out.append(
            (cells + ["ok" if not bad else "NO", "equal bits" if not bad else f"differ at {bad[:3]}", "-"], not bad)
        )
    out.append(_attention_row(device, dtype, head_dim, context))
    if bench is not None:
        for m in (1, 8, 64, 256):
            part = x[:m].contiguous()
            invariant = bench(lambda: batch_invariant_linear_triton(part, weight))
            cublas = bench(lambda: F.linear(part, weight))
            cells = ["batch invariance", "matmul time", name, f"M={m}, {features}x{features}", tile, "ok"]
            out.append(
                (cells + [f"{invariant:.3f} ms vs cuBLAS {cublas:.3f} ms ({cublas / invariant:.2f}x)", "-"], True)
            )
    return out


def _attention_row(device: str, dtype: torch.dtype, head_dim: int, context: int) -> Row:
    """One request's ``context`` tokens attended as a prefill and each as a decode row: equal bits?"""
    from cbrun.kernels.paged_attention import paged_attention_triton

    generator = torch.Generator().manual_seed(1)
    page_size, heads, kv_heads = 16, 8, 2
    pages = -(-context // page_size)
    k_cache, v_cache = (
        torch.randn(pages + 1, page_size, kv_heads, head_dim, generator=generator).to(device=device, dtype=dtype)
        for _ in range(2)
    )
    table = torch.randperm(pages, generator=generator).add(1).to(device=device, dtype=torch.int32)[None]
    query = torch.randn(context, heads, head_dim, generator=generator).to(device=device, dtype=dtype)

    def run(first: int, last: int) -> torch.Tensor:
        cu = torch.tensor([0, last - first], dtype=torch.int32, device=device)
        seqlens = torch.tensor([last], dtype=torch.int32, device=device)
        return paged_attention_triton(
            query[first:last].clone(), k_cache, v_cache, table, cu, seqlens, head_dim**-0.5, batch_invariant=True
        )

    prefill = run(0, context)
    bad = [
        p for p in sorted({0, context // 3, context // 2, context - 1}) if not torch.equal(run(p, p + 1)[0], prefill[p])
    ]
    cells = ["batch invariance", "attention decode = prefill", str(dtype).removeprefix("torch."), f"{context} tokens"]
    return (cells + ["-", "ok" if not bad else "NO", "equal bits" if not bad else f"differ at {bad}", "-"], not bad)
