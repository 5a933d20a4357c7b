"""``cbrun.kernels.gpu_check_quantized`` runs on the CPU (Triton's interpreter, tiny shapes), so the script a GPU
session will run is known to work: every kernel matches its reference, the table is printed, exit 2 without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")
from cbrun.kernels import gpu_check_quantized  # noqa: E402


def _timer(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def test_checks_run_and_pass_on_tiny_cpu_shapes(capsys):
    rows = gpu_check_quantized.run_checks("cpu", _timer, shapes=((48, 256), (40, 160)), rows=(1, 20),
                                          ceilings=(1e9, 1e9), w8a8=False)  # fmt: skip
    kernels = {row.kernel for row in rows}
    assert kernels == {"bf16 F.linear", "int4_gemm g128", "fp8_gemm block128", "fp8_gemm channel", "mxfp4_gemm"}
    assert len(rows) == 2 * 2 * 5 and all(row.ok for row in rows)
    assert "16x32x128 w4" in capsys.readouterr().out  # the decode tile of the wrappers


def test_a_wrong_kernel_is_reported(monkeypatch):
    monkeypatch.setattr(gpu_check_quantized, "quantized_matmul", lambda x, w, **k: torch.zeros(x.shape[0], w.shape[0]))
    rows = gpu_check_quantized.run_checks(
        "cpu", _timer, shapes=((48, 256),), rows=(1,), ceilings=(1e9, 1e9), w8a8=False
    )
    assert [row.ok for row in rows] == [True, False, False, False, False]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_exit_2_without_cuda(capsys):
    assert gpu_check_quantized.main() == 2 and "nothing was checked" in capsys.readouterr().out
