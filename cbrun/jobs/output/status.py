"""``cbrun status OUT_DIR``: how far a job's output is, per shard and in total, read from the committed parts.

Nothing is locked or written (a local directory or an object-store URI, ``cbrun.jobs.output.output_dir``): it reads ``_cbrun/job.json``, ``_cbrun/shards.json`` (the split of the rows, written
by every run), ``_cbrun/stats.json`` (the finished job's ``max_error_fraction``) and the parts' ``row_index`` and
``finish_reason`` columns, so it can watch running shards; which shards a live run holds now comes from the
host's lock table (``cbrun.jobs.output.lock.held_locks``), without taking a lock. Its exit code is the one ``cbrun run`` gives
for the same output (``status_report``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cbrun.jobs.output.lock import describe_holder
from cbrun.jobs.output.output_dir import OutputState, open_output
from cbrun.jobs.run.sharding import read_shards_file

#: ``output.max_error_fraction``'s default (``cbrun.jobs.config.settings.OutputSettings``), for outputs whose stats lack it.
DEFAULT_MAX_ERROR_FRACTION = 0.1


def too_many_errors(total_output_rows: int, error_rows: int, max_error_fraction: float) -> bool:
    """More error rows than ``max_error_fraction`` of the output rows allows; an output of error rows alone always
    (the rule behind exit code 3 of ``cbrun run`` and ``cbrun status``)."""
    total = total_output_rows
    return total > 0 and (error_rows == total or error_rows > max_error_fraction * total)


@dataclass
class ShardProgress:
    """One shard's (or the whole job's) progress.

    Attributes:
        name: "I/N", or "total".
        rows: the input rows ``[start, end)`` it covers.
        num_done: input rows with their output rows committed.
        num_error_rows: of those, rows with an error row (``finish_reason == "error"``).
    """

    name: str
    rows: tuple[int, int]
    num_done: int
    num_error_rows: int

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def complete(self) -> bool:
        return self.num_done == self.num_rows

    def line(self) -> str:
        where = "" if self.name == "total" else f" (input rows {self.rows[0]}..{self.rows[1] - 1})"
        state = "complete" if self.complete else "not complete"
        return (
            f"{self.name}: {self.num_done}/{self.num_rows} rows done{where}, {self.num_error_rows} error rows, {state}"
        )


def output_progress(output_dir: str | Path) -> list[ShardProgress]:
    """Each shard's progress, then the total (last).

    Raises:
        ValueError: when the directory holds no cbrun job.
    """
    return _read_progress(output_dir)[0]


def _read_progress(output_dir: str | Path) -> tuple[list[ShardProgress], OutputState]:
    """(``output_progress``, the whole output's ``OutputState``)."""
    checkpoint = open_output(output_dir)
    job = checkpoint.read_job_file()
    split = read_shards_file(checkpoint)
    if job is None:
        raise ValueError(f"{str(output_dir)!r} holds no cbrun job (no _cbrun/job.json)")
    if split is None:  # NOTE: an output of an older cbrun, which ran one process over the whole input
        num_rows = job["input"]["num_rows"]
        split = {"count": 1, "num_rows": num_rows, "ranges": [[0, num_rows]]}
    state = checkpoint.read_state(split["num_rows"])
    failed = np.zeros(split["num_rows"], dtype=bool)
    failed[state.error_rows] = True
    count = split["count"]
    progress = [
        ShardProgress(
            f"shard {i}/{count}", (start, end), int(state.done[start:end].sum()), int(failed[start:end].sum())
        )
        for i, (start, end) in enumerate(split["ranges"])
    ]
    progress.append(ShardProgress("total", (0, split["num_rows"]), int(state.done.sum()), int(failed.sum())))
    return progress, state


def _running_lines(output_dir: str | Path, progress: list[ShardProgress], complete: bool) -> list[str]:
    """Which runs hold the output's shard locks now; for an unfinished job, how to resume what no run holds: the
    same command, or for a sharded job each unfinished shard's own ``--shard I/N`` flag."""
    owner = open_output(output_dir)
    held = owner.held_locks()
    if held is None:  # NOTE: no /proc/locks here: say nothing rather than guess
        return []
    lines = [f"running now: shard {shard} ({describe_holder(record)})" for shard, record in held.items()]
    if complete:
        return lines
    shards = progress[:-1]
    unfinished = [p.name.removeprefix("shard ") for p in shards if not p.complete]
    idle = [name for name in unfinished if name not in held]
    if len(shards) > 1 and idle:
        flags = ", ".join(f"--shard {name}" for name in idle)
        lines.append(
            f"no cbrun run holds shard{'s' if len(idle) > 1 else ''} {', '.join(idle)} now: run the job "
            f"with {flags} (one run per shard) to resume {'them' if len(idle) > 1 else 'it'}"
        )
    elif not held:
        lines.append("no cbrun run holds this output now: rerun the same command to resume it")
    return lines


def status_report(output_dir: str | Path) -> tuple[str, int]:
    """The text ``cbrun status`` prints, and its exit code.

    Returns:
        (text, code): code 0 when the job is complete (every row committed, ``_SUCCESS``) with its error rows
        within ``output.max_error_fraction`` (read from ``_cbrun/stats.json``); 3 when complete with more error
        rows than that (the code ``cbrun run`` exits with); 1 when not complete.

    Raises:
        ValueError: when the directory holds no cbrun job.
    """
    progress, state = _read_progress(output_dir)
    checkpoint = open_output(output_dir)
    finished = checkpoint.is_finished()
    lines = [f"cbrun status: {output_dir}"] + [p.line() for p in (progress if len(progress) > 2 else progress[-1:])]
    complete = progress[-1].complete and finished
    lines += _running_lines(output_dir, progress, complete)
    if progress[-1].complete and not finished:
        lines.append("every row is committed, but _SUCCESS is missing: rerun any shard to finish the job")
    if not complete:
        lines.append("job not complete")
        return "\n".join(lines), 1
    stats = checkpoint.read_stats() or {}
    fraction = stats.get("max_error_fraction", DEFAULT_MAX_ERROR_FRACTION)
    errors = state.num_error_rows
    if not errors:
        lines.append("job complete (_SUCCESS written)")
        return "\n".join(lines), 0
    where = (
        f"{errors} of {state.num_output_rows} output rows are error rows (finish_reason = 'error'; their error "
        f"column says why; rerun them with cbrun run ... --retry-errors)"
    )
    if too_many_errors(state.num_output_rows, errors, fraction):
        lines.append(
            f"job complete (_SUCCESS written), but too many errors (exit code 3): {where}, above "
            f"output.max_error_fraction = {fraction:g}"
        )
        return "\n".join(lines), 3
    lines.append(f"job complete (_SUCCESS written): {where}")
    return "\n".join(lines), 0
