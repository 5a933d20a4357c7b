"""What the Triton kernel tests share: where the kernels run (Triton's CPU interpreter without a GPU), the rerun of
a test file in a fresh process when Triton was imported compiled first, and the kernel-vs-reference comparison.

``TRITON_INTERPRET=1`` only takes effect if it is set before Triton is first imported (``triton.language``'s own
helpers are decorated then): ``tests/conftest.py`` and this module set it. When an earlier test module already
imported Triton (transformers does, for one), the in-process tests skip (``in_process``) and each file's
``test_*_in_fresh_process`` runs it again in a fresh interpreter-mode process (``rerun_in_fresh_process``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"

triton = pytest.importorskip("triton")


def _runs_in_this_process() -> bool:
    """False when interpretation is wanted but Triton was imported (compiled mode) before the variable was set."""
    from triton.runtime.interpreter import InterpretedFunction

    return not INTERPRET or isinstance(triton.language.zeros, InterpretedFunction)


IN_PROCESS = _runs_in_this_process()
in_process = pytest.mark.skipif(
    not IN_PROCESS,
    reason="Triton was imported before TRITON_INTERPRET was set; the file's test_*_in_fresh_process runs these",
)


def rerun_in_fresh_process(test_file: str, flag: str) -> None:
    """Runs ``test_file`` again where TRITON_INTERPRET is set before Triton's first import; asserts it passes.

    Args:
        test_file: the test module's ``__file__``.
        flag: an environment variable set in the child, so that a child where interpretation still did not take
            effect fails instead of starting another.
    """
    assert not os.environ.get(flag), "TRITON_INTERPRET=1 did not take effect in a fresh process"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        env={**os.environ, "TRITON_INTERPRET": "1", flag: "1"},
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]


def check_close(got: torch.Tensor, want: torch.Tensor, tolerances: dict[torch.dtype, float]) -> None:
    """A kernel's output against its reference: same dtype and shape, no NaN left from the poisoned output, and
    the largest error at most ``tolerances[dtype]`` times the reference's largest magnitude (which must not be 0)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not torch.isnan(got).any(), "a value was never written (the output was poisoned with NaN)"
    peak = want.float().abs().max().item()
    assert peak > 0
    error = (got.float() - want.float()).abs().max().item()
    assert error <= tolerances[want.dtype] * peak, f"max error {error} at peak {peak}"
