"""``cbrun.kernels.gpu_check_fused_moe`` runs on the CPU (Triton's interpreter, tiny layers), so the script a GPU
session will run is known to work: every format matches its reference, the table is printed, exit 2 without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")
from cbrun.kernels import gpu_check_fused_moe  # noqa: E402
from cbrun.kernels.gpu_check_fused_moe import MoELayer  # noqa: E402

TINY = (
    MoELayer("tiny-qwen3", 128, 128, 4, 2, ("dense", "fp8", "int4")),
    MoELayer("tiny-gpt-oss", 64, 32, 4, 2, ("dense", "mxfp4"), gpt_oss=True),
)


def _timer(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def test_checks_run_and_pass_on_tiny_cpu_layers(capsys):
    rows = gpu_check_fused_moe.run_checks("cpu", _timer, layers=TINY, rows=(1, 5), ceilings=(1e9, 1e9))
    assert {row.kernel for row in rows} == {"fused_moe dense", "fused_moe fp8", "fused_moe int4", "fused_moe mxfp4"}
    assert len(rows) == 2 * 5 and all(row.ok for row in rows), [(r.kernel, r.max_err) for r in rows]
    assert "16x16x128 w4" in capsys.readouterr().out  # the gated decode tile


def test_a_wrong_kernel_is_reported(monkeypatch):
    monkeypatch.setattr(gpu_check_fused_moe, "fused_moe_triton", lambda x, *a, **k: torch.zeros_like(x))
    rows = gpu_check_fused_moe.run_checks("cpu", _timer, layers=TINY[:1], rows=(1,), ceilings=(1e9, 1e9))
    assert rows and not any(row.ok for row in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_exit_2_without_cuda(capsys):
    assert gpu_check_fused_moe.main() == 2 and "nothing was checked" in capsys.readouterr().out
