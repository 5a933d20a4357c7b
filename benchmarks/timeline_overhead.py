"""What recording the run's timeline (``cbrun.jobs.observe.timeline``) costs: the time spent in the recorder, and paired runs.

Two measurements on one engine, in one process, over the same job (stories260K, the CPU):

1. in-run: the seconds spent inside the recorder (``TimelineRecorder.__init__``, ``on_step``, ``close``: its whole
   work, file writes included), as a fraction of the run's generation seconds. Measured inside each run, so other load
   on the machine scales both sides alike.
2. paired: runs with the timeline (``output.timeline_interval_s``) and without (0), alternated, the ratio of their
   generation seconds (noisy on a shared machine: read it with the in-run figure).

Usage::

    PYTHONPATH=. python -m benchmarks.timeline_overhead --model MODEL_DIR [--rows 200] [--pairs 3]

Prints a table; ``benchmarks/results-timeline-overhead.md`` holds a run of it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from cbrun.jobs.observe.timeline import TimelineRecorder
from cbrun.jobs.run.job import run_job

WORDS = "once upon a time there was a little girl named lily she liked to play with her dog in the park".split()  # noqa: SIM905


class _Clock:
    """Adds up the wall and CPU seconds spent in the recorder's methods (patched on the class for the run).

    NOTE: on a machine with more runnable threads than cores, a call's wall time includes the times the OS ran
    something else; the thread's CPU time does not, so it is the recorder's own cost."""

    def __init__(self):
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.calls = 0
        self.slowest = (0.0, "")  # the longest single call's wall seconds, and its method

    def wrap(self, method):
        def timed(*args, **kwargs):
            start, cpu_start = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                wall = time.perf_counter() - start
                self.seconds += wall
                self.slowest = max(self.slowest, (wall, method.__name__))
                self.cpu_seconds += time.thread_time() - cpu_start
                self.calls += 1

        return timed


def write_input(path: Path, rows: int) -> None:
    prompts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 25)) for i in range(rows)]
    pq.write_table(pa.table({"prompt": prompts}), path)


def run_once(model: str, input_path: Path, out: Path, engine, interval_s: float, max_tokens: int):
    manifest = JobManifest(
        model=ModelSettings(path=model),
        input=InputSettings(path=str(input_path), prompt_column="prompt"),
        sampling=SamplingParams(max_new_tokens=max_tokens, temperature=0.8, ignore_eos=True),
        engine=engine.config,
        output=OutputSettings(path=str(out), timeline_interval_s=interval_s, overwrite=True),
    )
    clock = _Clock()
    steps_before = engine.stats.num_steps
    names = ("__init__", "on_step", "close")  # all of the recorder's work: record() runs inside on_step or close
    originals = [getattr(TimelineRecorder, name) for name in names]
    for name, method in zip(names, originals):
        setattr(TimelineRecorder, name, clock.wrap(method))
    try:
        summary = run_job(manifest, progress=False, engine=engine)
    finally:
        for name, method in zip(names, originals):
            setattr(TimelineRecorder, name, method)
    return summary, clock, engine.stats.num_steps - steps_before


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory (e.g. stories260K converted)")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args(argv)

    from cbrun.engine import LLMEngine

    config = EngineConfig(max_requests_per_batch=32, num_threads=1)
    engine = LLMEngine.from_pretrained(args.model, config)
    engine.config = config
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_input(tmp / "in.parquet", args.rows)
        run_once(args.model, tmp / "in.parquet", tmp / "warm", engine, 1.0, args.max_tokens)  # warm-up
        print(
            "| interval_s | run | generation s | steps | recorder calls | recorder wall s | recorder CPU s | "
            "recorder wall % of run | recorder CPU % of run | slowest call |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        ratios = []
        for pair in range(args.pairs):
            seconds = {}
            for interval in (1.0, 0.0, 0.001):
                summary, clock, steps = run_once(
                    args.model, tmp / "in.parquet", tmp / f"out-{pair}", engine, interval, args.max_tokens
                )
                seconds[interval] = summary.generation_s
                print(
                    f"| {interval:g} | {pair} | {summary.generation_s:.3f} | "
                    f"{steps} | {clock.calls} | {clock.seconds:.5f} | {clock.cpu_seconds:.5f} | "
                    f"{100 * clock.seconds / summary.generation_s:.3f} | "
                    f"{100 * clock.cpu_seconds / summary.generation_s:.3f} | "
                    f"{clock.slowest[1]} {1000 * clock.slowest[0]:.1f} ms |"
                )
            ratios.append(seconds[1.0] / seconds[0.0])
        print(
            f"\npaired generation-time ratio, timeline every 1 s / none: median {statistics.median(ratios):.3f} "
            f"(runs: {', '.join(f'{r:.3f}' for r in ratios)})"
        )


if __name__ == "__main__":
    main()
