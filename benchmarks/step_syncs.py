"""How many times a step makes the host wait for the device, per kind of row (issue 39: one read-back per step).

The counts of ``tests/engine/test_step_syncs.py``, printed as a table: the CPU stands in for the device, the
sampler takes its device paths, and every host read of a device value or blocking upload outside the forward pass
is counted and named by the function that made it (see that module's docstring). The step's own read-back of its
sampled ids is the "read-backs" column; the test asserts the counts this prints.

    PYTHONPATH=. python -m benchmarks.step_syncs
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import pytest

from tests.engine.test_step_syncs import KINDS, count_steps, install_counter


def measure(kind: str, demo_model_dir: Path) -> tuple[int, list[int], list[int], Counter]:
    """(steps counted, read-backs per step, other waits per step, where the other waits were) of one row kind."""
    params, config, structured, _ = KINDS[kind]
    with pytest.MonkeyPatch.context() as monkeypatch:
        syncs = install_counter(monkeypatch)
        readbacks, found, _ = count_steps(config, params, syncs, model_dir=demo_model_dir if structured else None)
    where = Counter(s for step in found for s in step)
    return len(readbacks), readbacks, [len(s) for s in found], where


def main() -> None:
    from cbrun.jobs.cli.demo import build_demo_model

    with tempfile.TemporaryDirectory(prefix="step-syncs-") as tmp:
        demo = build_demo_model(Path(tmp) / "model", max_position_embeddings=512)
        print("| row kind | steps | read-backs per step | other host waits per step | where (count over the steps) |")
        print("|---|---|---|---|---|")
        for kind in KINDS:
            steps, readbacks, others, where = measure(kind, demo)
            places = "; ".join(f"{w} ({n})" for w, n in where.items()) or "none"
            print(f"| {kind} | {steps} | {max(readbacks)} | {max(others)} | {places} |")


if __name__ == "__main__":
    main()
