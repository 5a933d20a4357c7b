"""``benchmarks.cpu_attention --paired``: every attention call of a real engine run is timed with both kernels."""

import pytest

from benchmarks.cpu_attention import paired_seconds
from cbrun.kernels.cpu_attention import SOURCE, unavailable_reason
from tests.conftest import require_stories260k

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"CPU attention kernel unavailable: {unavailable_reason()}"
)


def test_paired_harness_times_the_calls_the_engine_makes(tmp_path, monkeypatch):
    """The engine calls the kernel through ``StepKernels.attention``; a harness that wrapped another entry point
    timed nothing (and divided by zero in its table)."""
    require_stories260k()
    monkeypatch.setattr("benchmarks.cpu_attention.EVICT_BYTES", 1 << 16)  # the timings' realism is not tested here
    old = tmp_path / "cpu_paged_attention.c"
    old.write_text(SOURCE.read_text() + "\n/* the old version */\n")
    seconds, calls = paired_seconds(old, "gsm8k-long", 3, (3, 64), page_size=16)
    assert calls["all"] == calls["decode"] + calls["with prefill rows"]
    assert calls["decode"] > 0 and calls["with prefill rows"] > 0
    for kind in ("decode", "with prefill rows"):
        assert seconds[kind, "old"] > 0 and seconds[kind, "new"] > 0
