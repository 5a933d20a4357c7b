"""The GPU suite's batch-invariance part (``benchmarks.batch_invariant_gpu_check``) runs, and can fail, on the CPU:
the same code in Triton's interpreter on tiny shapes, without timings."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from benchmarks import batch_invariant_gpu_check  # noqa: E402
from cbrun.kernels.batch_invariant import triton_invariant_unavailable_reason  # noqa: E402

REASON = triton_invariant_unavailable_reason("cpu", torch.float32)
pytestmark = pytest.mark.skipif(torch.cuda.is_available() or REASON is not None, reason=str(REASON))
SMALL = dict(rows=140, features=48, dtype=torch.float32, head_dim=32, context=40)


def test_rows_are_all_equal_bits_on_the_invariant_kernels():
    rows = batch_invariant_gpu_check.invariance_rows("cpu", **SMALL)
    assert [cells[1] for cells, _ in rows] == ["matmul rows", "rms_norm rows", "attention decode = prefill"]
    assert all(ok for _, ok in rows), rows


def test_a_batch_dependent_matmul_is_reported(monkeypatch):
    # F.linear padded by the row count stands in for a kernel whose rows follow the batch.
    from cbrun.kernels import batch_invariant_matmul

    def varying(x, weight, bias=None, out=None):
        return torch.nn.functional.linear(x, weight) * (1.0 + 1e-3 * (x.shape[0] % 2))

    monkeypatch.setattr(batch_invariant_matmul, "batch_invariant_linear_triton", varying)
    rows = batch_invariant_gpu_check.invariance_rows("cpu", **SMALL)
    assert not rows[0][1] and rows[0][0][5] == "NO"
