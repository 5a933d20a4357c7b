"""A run's timeline: the engine's counters and the run's row counts, sampled about once a second into
``_cbrun/timeline-<run>.jsonl``, an append-only file that ``cbrun report`` (``cbrun.jobs.observe.report``) draws.

The file's first line is the run's header (``"kind": "run"``: its id, shard or replica, start time, the engine
settings that ran, the model); every other line is a sample (``"kind": "sample"``), the last one written when the
run ends (``"final": true``; a killed run's timeline simply stops). Counters are cumulative since the run's start,
so a lost or partial line loses nothing of the totals; the per-interval values (batch tokens per step, seconds per
step) cover the steps since the previous sample. One file per run, shard and Ray replica: no two writers ever
share a file.

The engine calls ``TimelineRecorder.on_step`` after each step (``LLMEngine.step_listener``); all it does per step
is add to a few numbers and compare the clock with the next sample's time, so recording costs well under 1% of a
run (``benchmarks/timeline_overhead.py``).
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from cbrun.jobs.output.lock import CBRUN_DIR

#: Seconds between flushes of the timeline file to the operating system (and the final sample, at close).
FLUSH_EVERY_S = 10.0
#: Seconds between uploads of a timeline whose output is in an object store (a whole PUT each time).
UPLOAD_EVERY_S = 60.0
#: The timeline files of an output directory's ``_cbrun/``.
TIMELINE_GLOB = "timeline-*.jsonl"


#: Runs started in this process so far: a second run within the same second gets its own id.
_runs_in_process = itertools.count()


def run_id() -> str:
    """A run's id: its UTC start time to the second and its process id (``20261202T190512Z-4242``), then ``-N``
    for the process's run N > 0 (tests and notebooks run several jobs in one process)."""
    number = next(_runs_in_process)
    suffix = f"-{number}" if number else ""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}{suffix}"


def timeline_name(run: str, part: str = "") -> str:
    """``timeline-<run>[-<part>].jsonl``, a file of the output's ``_cbrun/``; ``part`` names a shard
    (``shard-0-of-2``) or a replica."""
    return f"timeline-{run}-{part}.jsonl" if part else f"timeline-{run}.jsonl"


class TimelineRecorder:
    """Samples one engine and one run's row counts into a timeline file every ``interval_s`` seconds.

    Owns the file and the counts of the steps since its last sample; reads the engine's counters (``cbrun.engine.core.stats``,
    the scheduler's queues, the block manager's free blocks) and never changes them.

    Args:
        output: the output's owner (``cbrun.jobs.output.output_dir.OutputDir``): the file is its ``_cbrun/<name>``.
        name: the timeline file's name (``timeline_name``; created; appended to).
        engine: the ``LLMEngine`` whose steps are recorded; its ``step_listener`` must call ``on_step``
            (``step_listeners``).
        rows: returns ``(rows done, error rows)`` of this run so far (the job's summary).
        interval_s: seconds between samples (> 0).
        header: extra keys for the header line (shard, model, engine settings; dataclasses become dicts).
    """

    def __init__(
        self,
        output,
        name: str,
        engine,
        rows: Callable[[], tuple[int, int]],
        interval_s: float = 1.0,
        header: dict[str, Any] | None = None,
    ):
        assert interval_s > 0, interval_s
        # NOTE: an object store has no append: the timeline is written to a local file and uploaded whole (one
        # PUT) every UPLOAD_EVERY_S seconds and at close, so a killed run loses at most that much of it there.
        self.output = output
        self.remote = f"{CBRUN_DIR}/{name}" if output.local_dir is None else None
        self.path = Path(tempfile.gettempdir(), "cbrun-timelines", name) if self.remote else output.cbrun_dir / name
        self.next_upload = time.perf_counter() + UPLOAD_EVERY_S
        self.engine = engine
        self.rows = rows
        self.interval_s = interval_s
        self.started = time.perf_counter()
        self.next_sample = self.started + interval_s
        self.next_flush = self.started + FLUSH_EVERY_S
        self.at_start = _counters(engine.stats)
        self._reset_window()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by ``close``)
        head = {
            "kind": "run",
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "interval_s": interval_s,
            "kv_blocks_total": engine.block_manager.num_blocks,
        }
        for key, value in (header or {}).items():
            head[key] = asdict(value) if is_dataclass(value) else value
        self._write(head)
        self._write(self.sample())  # t = 0: the run's counters start at zero
        self._file.flush()

    def on_step(self, batch_tokens: int, seconds: float) -> None:
        """``LLMEngine.step_listener``: count one step (its batch tokens and wall seconds); sample when due."""
        self.window_steps += 1
        self.window_tokens += batch_tokens
        self.window_seconds += seconds
        self.window_max_tokens = max(self.window_max_tokens, batch_tokens)
        if time.perf_counter() >= self.next_sample:
            self.record()

    def record(self, final: bool = False, flush: bool = False) -> None:
        """Write one sample now and start the next interval; ``flush``: hand the file to the OS now (e.g. idle)."""
        self._write(self.sample(final))
        self._reset_window()
        now = time.perf_counter()
        self.next_sample = now + self.interval_s
        if flush or now >= self.next_flush:
            # NOTE: a write to a busy disk can take milliseconds; flushing every FLUSH_EVERY_S seconds rather than
            # every sample keeps that off most steps (a killed run loses at most that much of its timeline).
            self._file.flush()
            self.next_flush = now + FLUSH_EVERY_S
            if self.remote is not None and now >= self.next_upload:
                self._upload()
                self.next_upload = now + UPLOAD_EVERY_S

    def close(self) -> None:
        """Write the final sample and close the file (safe to call twice)."""
        if self._file.closed:
            return
        self.record(final=True)
        self._file.close()
        if self.remote is not None:
            self._upload()

    def _upload(self) -> None:
        """Put the local copy's bytes so far into the output's store (one PUT)."""
        if not self._file.closed:
            self._file.flush()
        self.output.store.write_atomic(self.remote, self.path.read_bytes())

    def sample(self, final: bool = False) -> dict[str, Any]:
        """The run's counters now, cumulative since its start, and the steps since the last sample.

        Keys: ``t`` (seconds since the run's start), ``rows_done``, ``rows_errors``, ``prompt_tokens`` and
        ``cached_prompt_tokens`` (of finished requests; cached: prefix-cache hits), ``generated_tokens``,
        ``computed_tokens`` (prefilled and decoded), ``running`` and ``waiting`` requests, ``kv_blocks_used``,
        ``steps``, ``offloads``, ``soft_resets``, ``spec_proposed``, ``spec_accepted``, ``failed_requests``;
        over the interval: ``interval_steps``, ``batch_tokens_mean``, ``batch_tokens_max``, ``step_s_mean``
        (wall seconds per step, host and device together), ``device_s_mean`` (None: not measured).
        """
        engine = self.engine
        stats, start = _counters(engine.stats), self.at_start
        done, errors = self.rows()
        steps = self.window_steps

        def since_start(key: str) -> int:
            return stats[key] - start[key]

        record = {
            "kind": "sample",
            "t": round(time.perf_counter() - self.started, 4),
            "rows_done": done,
            "rows_errors": errors,
            "prompt_tokens": since_start("num_prompt_tokens"),
            "cached_prompt_tokens": since_start("num_cached_prompt_tokens"),
            "generated_tokens": since_start("num_generated_tokens"),
            "computed_tokens": since_start("num_computed_tokens"),
            "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting),
            "kv_blocks_used": engine.block_manager.num_blocks - engine.block_manager.num_free_blocks,
            "steps": since_start("num_steps"),
            "offloads": since_start("num_offloads"),
            "soft_resets": since_start("num_soft_resets"),
            "spec_proposed": since_start("num_proposed_tokens"),
            "spec_accepted": since_start("num_accepted_tokens"),
            "failed_requests": since_start("num_failed_requests"),
            "interval_steps": steps,
            "batch_tokens_mean": round(self.window_tokens / steps, 2) if steps else 0.0,
            "batch_tokens_max": self.window_max_tokens,
            "step_s_mean": round(self.window_seconds / steps, 6) if steps else None,
            "device_s_mean": None,
        }
        if final:
            record["final"] = True
        return record

    def _reset_window(self) -> None:
        self.window_steps = 0
        self.window_tokens = 0
        self.window_max_tokens = 0
        self.window_seconds = 0.0

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")


#: The ``EngineStats`` counters a sample reads.
_COUNTERS = (
    "num_prompt_tokens",
    "num_cached_prompt_tokens",
    "num_generated_tokens",
    "num_computed_tokens",
    "num_steps",
    "num_offloads",
    "num_soft_resets",
    "num_proposed_tokens",
    "num_accepted_tokens",
    "num_failed_requests",
)


def _counters(stats) -> dict[str, int]:
    return {name: getattr(stats, name) for name in _COUNTERS}


def step_listeners(*listeners: Callable[[int, float], None] | None) -> Callable[[int, float], None] | None:
    """One ``LLMEngine.step_listener`` that calls each of ``listeners`` (None ones left out) in turn."""
    chosen = [listener for listener in listeners if listener is not None]
    if len(chosen) <= 1:
        return chosen[0] if chosen else None

    def call_each(batch_tokens: int, seconds: float) -> None:
        for listener in chosen:
            listener(batch_tokens, seconds)

    return call_each


def read_timeline(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A timeline file's header and samples; a torn last line (a killed run) is skipped.

    Raises:
        ValueError: the file has no header line.
    """
    header, samples = None, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("kind") == "run" and header is None:
                header = record
            elif record.get("kind") == "sample":
                samples.append(record)
    if header is None:
        raise ValueError(f"{path}: not a cbrun timeline (no header line)")
    return header, samples
