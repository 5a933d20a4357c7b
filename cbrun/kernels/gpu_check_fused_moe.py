"""GPU check of the fused MoE kernel (``cbrun.kernels.fused_moe``): correctness against its PyTorch reference on
the dequantized experts, and speed against the copy-bandwidth roofline and bf16 experts through
``torch._grouped_mm``.

Run on a CUDA machine with ``python -m cbrun.kernels.gpu_check_fused_moe``: exit 0 when every launch matches its
reference, 1 on a mismatch, 2 without CUDA (nothing checked; the CPU tests are ``tests/kernels/test_fused_moe.py``,
in Triton's interpreter). One table, as ``cbrun.kernels.gpu_check``'s::

    kernel | dtype | shape | tile | max err | ok | ms | GB/s | TFLOP/s | roofline

``shape`` is ``tokens x k/E x hidden x I`` of one MoE layer (Qwen3-30B-A3B's with dense, FP8 128 x 128 and int4
g128 experts, SiLU; gpt-oss-20b's with dense and MXFP4 experts, biases and the clamped SwiGLU), routed uniformly at
random; ``tile`` the gated launch's (``fused_moe.fused_moe_launch_config``); ``max err`` relative to the largest
|reference| value. ``GB/s`` counts each non-empty row tile's expert weights once in their stored bytes (the tile
map's), plus the activations, and ``roofline`` is that rate over the measured copy bandwidth (decode is memory
bound). ``grouped_mm bf16`` rows time bf16 experts through ``torch._grouped_mm`` (sm_90+), the path dense bf16
experts take there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cbrun.kernels.fused_moe import (
    ExpertWeights,
    expert_tile_map,
    fused_moe_launch_config,
    fused_moe_reference,
    fused_moe_triton,
)
from cbrun.kernels.gpu_check import Row, check_main, measure_ceilings, print_table
from cbrun.kernels.paged_attention import device_capability

#: Largest |error| relative to the largest |reference| value, bf16 (a few units in the last place).
TOLERANCE = 1.6e-2
#: Tokens per launch: decode, a decode batch, a prefill-sized batch.
ROWS = (1, 16, 256)


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer's expert shapes and the formats checked on it."""

    name: str
    hidden: int
    width: int
    experts: int
    top_k: int
    formats: tuple[str, ...]
    gpt_oss: bool = False


LAYERS = (
    MoELayer("Qwen3-30B-A3B", 2048, 768, 128, 8, ("dense", "fp8", "int4")),
    MoELayer("gpt-oss-20b", 2880, 2880, 32, 4, ("dense", "mxfp4"), gpt_oss=True),
)


def make_experts(fmt: str, e: int, n: int, k: int, device: str, g: torch.Generator) -> ExpertWeights:
    """Random (E, n, k) experts in ``fmt`` on ``device`` (bf16 when dense)."""
    if fmt == "dense":
        return ExpertWeights("dense", (torch.randn(e, n, k, generator=g) / k**0.5).to(device, torch.bfloat16))
    if fmt == "fp8":
        q = (torch.randn(e, n, k, generator=g) * 40).to(torch.float8_e4m3fn)
        scale = torch.rand(e, -(-n // 128), -(-k // 128), generator=g) * 0.002 / k**0.5
        return ExpertWeights("fp8", q.to(device), scale.to(device), None, k, (128, 128))
    if fmt == "int4":
        groups = -(-k // 128)
        packed = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), generator=g, dtype=torch.int32)
        zeros = torch.randint(0, 16, (e, n, groups), generator=g, dtype=torch.uint8)
        scales = torch.rand(e, n, groups, generator=g) * 0.2 / k**0.5
        return ExpertWeights("int4", packed.to(device), scales.to(device), zeros.to(device), k, (1, 128))
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 122, (e, n, k // 32), generator=g, dtype=torch.uint8)
    return ExpertWeights("mxfp4", blocks.to(device), scales.to(device))


def check_layer(layer: MoELayer, rows: int, device: str, bench: Callable, ceilings: tuple[float, float]) -> list[Row]:
    """Each format's fused launch pair at ``rows`` tokens on ``layer``, against the reference, timed."""
    g = torch.Generator().manual_seed(rows + layer.hidden)
    e, hidden, width, top_k = layer.experts, layer.hidden, layer.width, layer.top_k
    x = torch.randn(rows, hidden, generator=g).to(device, torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(rows)]).to(device)
    weights = torch.softmax(torch.randn(rows, top_k, generator=g), dim=-1).to(device, torch.bfloat16)
    kwargs: dict = {}
    if layer.gpt_oss:
        bias = (torch.randn(e, 2 * width, generator=g) * 0.1).to(device, torch.bfloat16)
        down_bias = (torch.randn(e, hidden, generator=g) * 0.1).to(device, torch.bfloat16)
        kwargs = dict(activation="swiglu_oai", gate_bias=bias[:, 0::2], up_bias=bias[:, 1::2], down_bias=down_bias)
    shape = f"{rows}x{top_k}/{e}x{hidden}x{width}"
    out = []
    for fmt in layer.formats:
        gate_up = make_experts(fmt, e, 2 * width, hidden, device, g)
        gate, up = _halves(gate_up, width, interleaved=layer.gpt_oss)
        down = make_experts(fmt, e, hidden, width, device, g)
        got = fused_moe_triton(x, weights, ids, gate, up, down, **kwargs)
        real_gate, real_up, real_down = (w.dequantize(torch.bfloat16) for w in (gate, up, down))
        want = fused_moe_reference(x, weights, ids, real_gate, real_up, real_down, **kwargs).float()
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        ms = bench(lambda gate=gate, up=up, down=down: fused_moe_triton(x, weights, ids, gate, up, down, **kwargs))
        config = fused_moe_launch_config(
            torch.bfloat16, rows * top_k, e, min(gate.block_k_cap, down.block_k_cap), device_capability(x.device),
            fmt, True, kwargs.get("activation", "silu"), bool(kwargs), False,
        )  # fmt: skip
        c = config.constexprs
        _, tile_map = expert_tile_map(ids, e, c["BLOCK_M"])
        tiles = int((tile_map[2] > tile_map[1]).sum())
        per_expert = (gate.nbytes + up.nbytes + down.nbytes) // e
        moved = tiles * per_expert + rows * top_k * (2 * hidden + 4 * width + 8 * hidden) + 2 * rows * hidden
        tile = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{config.num_warps}"
        out.append(Row(f"fused_moe {fmt}", "bfloat16", shape, tile, err, err <= TOLERANCE, ms, moved, 0.0, ceilings[0]))
        if fmt == "dense" and not layer.gpt_oss and _grouped_mm_runs(x):
            ms = bench(lambda: _grouped_mm_experts(x, weights, ids, gate_up.data, down.data))
            out.append(Row("grouped_mm bf16", "bfloat16", shape, "torch", 0.0, True, ms, moved, 0.0, ceilings[0]))
    return out


def _halves(gate_up: ExpertWeights, width: int, interleaved: bool) -> tuple[ExpertWeights, ExpertWeights]:
    """Gate and up of a stacked (E, 2I, K) projection: rows [0, I) and [I, 2I), or every other row (gpt-oss)."""
    parts = []
    for i in range(2):
        pick = slice(i, None, 2) if interleaved else slice(i * width, (i + 1) * width)
        rows_per_scale = gate_up.block[0] if gate_up.format == "fp8" else 1
        scale_pick = slice(pick.start // rows_per_scale, -(-pick.stop // rows_per_scale)) if pick.stop else pick
        parts.append(
            ExpertWeights(
                gate_up.format,
                gate_up.data[:, pick],
                None if gate_up.scales is None else gate_up.scales[:, scale_pick],
                None if gate_up.zeros is None else gate_up.zeros[:, pick],
                gate_up.in_features,
                gate_up.block,
            )
        )
    return parts[0], parts[1]


def _grouped_mm_runs(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability() >= (9, 0)


def _grouped_mm_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """bf16 experts through ``torch._grouped_mm`` (the lean MoE's grouped path, routing given)."""
    top_k, width = ids.shape[1], down.shape[-1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)
    h = torch._grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offs=offsets)
    h = torch.nn.functional.silu(h[:, :width]) * h[:, width:]
    y = torch._grouped_mm(h, down.transpose(1, 2), offs=offsets) * weights.reshape(-1)[order, None]
    out = torch.empty_like(y)
    out[order] = y
    return out.view(x.shape[0], top_k, -1).sum(dim=1)


def run_checks(
    device: str,
    bench: Callable,
    layers: tuple[MoELayer, ...] = LAYERS,
    rows: tuple[int, ...] = ROWS,
    ceilings: tuple[float, float] | None = None,
) -> list[Row]:
    """Every layer x format x row count on ``device``, timed with ``bench(fn) -> ms``; prints the table."""
    if ceilings is None:
        ceilings = measure_ceilings(device, bench)
    print(f"ceilings: copy {ceilings[0] / 1e9:.0f} GB/s (read + write)")
    table = [row for layer in layers for m in rows for row in check_layer(layer, m, device, bench, ceilings)]
    print_table(table)
    return table


def main() -> int:
    """Check and time the fused MoE kernel on the current CUDA device: 0 correct, 1 a mismatch, 2 without CUDA."""
    return check_main("gpu_check_fused_moe", "tests/kernels/test_fused_moe.py", run_checks)


if __name__ == "__main__":
    sys.exit(main())
