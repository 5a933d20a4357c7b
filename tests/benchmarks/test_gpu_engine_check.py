"""The GPU checks (benchmarks.gpu_engine_check, benchmarks.gpu_suite), shrunk or refused on the CPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_engine_checks_run_on_a_tiny_cpu_model(capsys, tmp_path, monkeypatch):
    """The engine part, shrunk to a tiny model on the CPU, so its first GPU run is not its first run: the swap mode
    preempts and still equals the plain mode token for token; no model directory is left behind."""
    import tempfile

    from benchmarks.gpu_engine_check import engine_checks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tiny = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    rows = engine_checks(None, device="cpu", model=tiny, max_prompt=64, check_requests=6, check_new_tokens=8)
    assert [(row.part, row.mode) for row in rows] == [("correctness", "plain"), ("correctness", "swap")]
    assert all(row.ok and row.equal == row.total == 6 and row.tokens_per_s > 0 for row in rows)
    assert rows[1].offloads > 0  # the swap mode did swap
    out = capsys.readouterr().out
    assert "engine part" in out and "6/6" in out
    assert not list(tmp_path.glob("cbrun-gpu-check-*"))


def test_engine_row_fails_only_a_gated_mismatch():
    from benchmarks.gpu_engine_check import EngineRow

    assert not EngineRow("correctness", "graphs", "float32", 1.0, 1.0, 5, 6, 0, None, gate=True).ok
    assert EngineRow("speed", "graphs", "bfloat16", 1.0, 1.0, 5, 6, 0, None, gate=False).ok


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("module", ["benchmarks.gpu_suite", "benchmarks.gpu_engine_check", "cbrun.kernels.gpu_check"])
def test_gpu_scripts_refuse_without_cuda(module, tmp_path):
    """Without CUDA each GPU script says so and exits 2 (nothing was checked), writing no results file."""
    result = subprocess.run(
        [sys.executable, "-m", module, "--results", str(tmp_path / "r.md")],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no CUDA device" in result.stdout
    assert not (tmp_path / "r.md").exists()


def test_gpu_suite_table_from_both_parts(monkeypatch):
    """The suite's one table takes the kernel and engine rows as the GPU gives them (here faked) and fails on
    any failed row."""
    from benchmarks import gpu_engine_check, gpu_suite
    from cbrun.kernels import gpu_check

    kernel = gpu_check.Row(
        "attention decode tile", "float32", "B=128 D=256", "16x32 w8", 1e-6, True, 0.5, 2e9, 0.0, 4e12
    )
    bad = gpu_engine_check.EngineRow("correctness", "graphs", "float32", 900.0, 1.5, 31, 32, 0, None, gate=True)
    monkeypatch.setattr(gpu_check, "run_checks", lambda *args, **kwargs: [kernel])
    monkeypatch.setattr(gpu_engine_check, "engine_checks", lambda *args, **kwargs: [bad])
    rows = gpu_suite.kernel_rows((4e12, 1e15)) + gpu_suite.engine_rows(4e12)
    assert [ok for _, ok in rows] == [True, False]
    text = gpu_suite.report(rows, 12.0, "a fake GPU")
    assert "1 check(s) FAILED" in text and "16x32 w8" in text and "31/32 equal" in text
    assert text.count("\n| ") == 0 and len([line for line in text.splitlines() if " | " in line]) == 3


def test_gpu_suite_quantized_rows(monkeypatch):
    """The quantized GEMMs' check becomes suite rows under the part "quantized", a mismatch a failed row."""
    from benchmarks import gpu_suite
    from cbrun.kernels import gpu_check, gpu_check_quantized

    good = gpu_check.Row("int4_gemm g128", "bfloat16", "1x4096x4096", "16x32x128 w4", 1e-3, True, 0.01, 9e6, 0.0, 4e12)
    bad = gpu_check.Row("mxfp4_gemm", "bfloat16", "1x4096x4096", "16x32x128 w4", 0.5, False, 0.01, 9e6, 0.0, 4e12)
    monkeypatch.setattr(gpu_check_quantized, "run_checks", lambda *args, **kwargs: [good, bad])
    rows = gpu_suite.quantized_rows((4e12, 1e15))
    assert [ok for _, ok in rows] == [True, False] and rows[0][0][:2] == ["quantized", "int4_gemm g128"]


def test_gpu_suite_fused_moe_rows(monkeypatch):
    """The fused MoE kernel's check becomes suite rows under the part "fused_moe", a mismatch a failed row."""
    from benchmarks import gpu_suite
    from cbrun.kernels import gpu_check, gpu_check_fused_moe

    good = gpu_check.Row(
        "fused_moe fp8", "bfloat16", "1x8/128x2048x768", "16x16x128 w4", 1e-3, True, 0.02, 9e6, 0.0, 4e12
    )
    bad = gpu_check.Row(
        "fused_moe mxfp4", "bfloat16", "1x4/32x2880x2880", "16x16x128 w4", 0.5, False, 0.02, 9e6, 0.0, 4e12
    )
    monkeypatch.setattr(gpu_check_fused_moe, "run_checks", lambda *args, **kwargs: [good, bad])
    rows = gpu_suite.fused_moe_rows((4e12, 1e15))
    assert [ok for _, ok in rows] == [True, False] and rows[0][0][:2] == ["fused_moe", "fused_moe fp8"]
