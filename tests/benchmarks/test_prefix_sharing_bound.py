"""``benchmarks.prefix_sharing_bound``: the per-step cost fit recovers each part's seconds."""

import numpy as np
import pytest

from benchmarks.prefix_sharing_bound import fit, report


def test_fit_splits_exact_step_times_into_their_parts():
    rng = np.random.default_rng(0)
    prefill, decodes, context = rng.integers(0, 512, 200), rng.integers(0, 128, 200), rng.integers(0, 40000, 200)
    seconds = 1e-3 + 20e-6 * prefill + 5e-6 * decodes + 100e-9 * context
    parts = fit(np.c_[seconds, prefill, decodes, context].astype(float))
    assert parts["fixed"] == pytest.approx(200 * 1e-3)
    assert parts["prefill"] == pytest.approx(20e-6 * prefill.sum())
    assert parts["decode"] == pytest.approx(5e-6 * decodes.sum() + 100e-9 * context.sum())
    assert parts["r2"] == pytest.approx(1.0)
    text = report({True: (2.0, parts), False: (3.0, parts)}, "cmd", 16)
    assert "Measured ratio (no sharing / sharing wall time): 1.50x" in text
