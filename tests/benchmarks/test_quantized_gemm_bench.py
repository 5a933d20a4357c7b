"""benchmarks.quantized_gemm: the bytes per decoded token come from the kernels' launch configurations and meet
the issue's targets on decode (FP8 >= 1.8x, int4 and MXFP4 >= 3x fewer than bf16)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
from benchmarks import quantized_gemm  # noqa: E402


def test_decode_bytes_meet_the_targets(monkeypatch):
    # A smaller layer keeps the test fast; the ratios depend on the shapes only through the activations' share.
    monkeypatch.setattr(quantized_gemm, "LAYER", (("proj", 1024, 1024),))
    monkeypatch.setattr(quantized_gemm, "EXPERT", (("proj", 1024, 1024),))
    gains = {name: gain for rows, name, _, gain, _ in quantized_gemm.bytes_table([1], 90)}
    assert gains["bf16 (Llama-3-8B layer)"] == 1.0
    assert gains["fp8 block 128x128"] >= 1.8 and gains["fp8 per-channel"] >= 1.8
    assert gains["int4 group 128"] >= 3 and gains["mxfp4"] >= 3


def test_weight_is_reread_per_row_tile():
    layout = quantized_gemm.int4_layout(256, 256)
    one, tiles_one = quantized_gemm.launch_bytes(layout, 256, 256, 1, 90)
    many, tiles_many = quantized_gemm.launch_bytes(layout, 256, 256, 256, 90)
    assert tiles_one == 1 and tiles_many == 4
    weight = quantized_gemm.weight_bytes(layout, 256, 256)
    assert one == weight + 2 * (256 + 256) and many == 4 * weight + 2 * 256 * 512
