"""The numbers behind ``cbrun report``: an output directory's timelines, rows and job files as plain series.

Everything here is plain Python over what the run wrote (``_cbrun/timeline-*.jsonl``, ``_cbrun/stats.json``,
``_cbrun/job.json``, the parts' columns); ``cbrun.jobs.observe.report_charts`` only draws it, so the tests check these numbers
against the run's own counts.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbrun.jobs.observe.timeline import TIMELINE_GLOB, read_timeline
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.output.writer import committed_parts

#: Output columns the report reads.
ROW_COLUMNS = ["num_prompt_tokens", "num_completion_tokens", "finish_reason", "error", "ttft_s", "decode_s", "queue_s"]
_ROW_PREFIX = re.compile(r"^row \d+ \((?:custom_)?id .*?\): ")
#: A number standing alone (not the 8 of "utf-8" or the 32 of "float32"), which varies between rows of one cause.
_NUMBER = re.compile(r"(?<![\w-])\d+(?!\w)")


@dataclass
class Timeline:
    """One run's (or shard's, or replica's) timeline file.

    Attributes:
        label: the run id, and its shard or replica when it is one.
        header: the file's header line (``cbrun.jobs.observe.timeline``).
        samples: its samples, in time order; counters cumulative since the run's start.
    """

    label: str
    header: dict[str, Any]
    samples: list[dict[str, Any]]

    @property
    def duration_s(self) -> float:
        """Seconds from the run's start to its last sample."""
        return self.samples[-1]["t"] if self.samples else 0.0

    @property
    def ends_early(self) -> bool:
        """Whether the file has no final sample: the run was killed (or is still running), so its counters stop at
        its last flush, the last part it committed."""
        return not self.samples or not self.samples[-1].get("final", False)

    def final(self, key: str) -> int:
        """A cumulative counter's value at the last sample (0 without samples)."""
        return self.samples[-1][key] if self.samples else 0

    def times(self) -> list[float]:
        return [s["t"] for s in self.samples]

    def values(self, key: str) -> list:
        return [s[key] for s in self.samples]

    def rate(self, key: str) -> tuple[list[float], list[float]]:
        """Per second of a cumulative counter over each interval, at the interval's end. The intervals run from the
        first sample to the last, back to back (samples at the same time fall into the next interval)."""
        t, y = [], []
        if not self.samples:
            return t, y
        a = self.samples[0]
        for b in self.samples[1:]:
            if b["t"] > a["t"]:
                t.append(b["t"])
                y.append((b[key] - a[key]) / (b["t"] - a["t"]))
                a = b
        return t, y

    def ratio(self, part: str, whole: str) -> tuple[list[float], list[float]]:
        """``Δpart / Δwhole`` between consecutive samples where ``whole`` grew (e.g. the prefix-cache hit rate)."""
        t, y = [], []
        for a, b in zip(self.samples, self.samples[1:]):
            if b[whole] > a[whole]:
                t.append(b["t"])
                y.append((b[part] - a[part]) / (b[whole] - a[whole]))
        return t, y

    def kv_occupancy(self) -> list[float]:
        """KV blocks in use over all blocks, at each sample (0..1)."""
        total = self.header.get("kv_blocks_total") or 0
        return [s["kv_blocks_used"] / total if total else 0.0 for s in self.samples]


def load_timelines(cbrun_dir: str | Path) -> list[Timeline]:
    """Every timeline of the output's ``_cbrun/``, oldest run first (a resumed job has one per run)."""
    timelines = []
    for path in sorted(Path(cbrun_dir).glob(TIMELINE_GLOB)):
        try:
            header, samples = read_timeline(path)
        except ValueError:
            continue  # NOTE: a file killed before its header line: nothing to draw
        part = header.get("part", "whole job")
        label = header.get("run", path.stem) + ("" if part == "whole job" else f" {part}")
        timelines.append(Timeline(label, header, samples))
    return sorted(timelines, key=lambda tl: (tl.header.get("started_at", ""), tl.label))


def error_cause(message: str | None) -> str:
    """An error row's cause without its row and id, numbers as N, at most 90 characters: rows with the same
    cause fall together."""
    cause = _NUMBER.sub("N", _ROW_PREFIX.sub("", message or "(no message)"))
    return cause if len(cause) <= 90 else cause[:87] + "..."


@dataclass
class RowData:
    """The per-row columns the report draws, error rows apart.

    Attributes:
        prompt_tokens / completion_tokens: per output row that is not an error row.
        ttft_s / decode_s / queue_s: per output row that has them (generate mode, rows of this version).
        errors: error rows by cause (``error_cause``), most frequent first.
        num_rows / num_error_rows: output rows, and of them error rows.
    """

    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    queue_s: list[float] = field(default_factory=list)
    errors: list[tuple[str, int]] = field(default_factory=list)
    num_rows: int = 0
    num_error_rows: int = 0


def load_rows(output_dir: str | Path) -> RowData:
    """The report's columns of every committed row of ``output_dir``."""
    data = RowData()
    if not committed_parts(output_dir):
        return data
    columns = read_output(output_dir, columns=ROW_COLUMNS).to_pydict()
    data.num_rows = len(columns["finish_reason"])
    causes = Counter()
    for i, reason in enumerate(columns["finish_reason"]):
        if reason == "error":
            causes[error_cause(columns["error"][i])] += 1
            continue
        data.prompt_tokens.append(columns["num_prompt_tokens"][i])
        if columns["num_completion_tokens"][i] is not None:
            data.completion_tokens.append(columns["num_completion_tokens"][i])
        for name in ("ttft_s", "decode_s", "queue_s"):
            if columns[name][i] is not None:
                getattr(data, name).append(columns[name][i])
    data.errors = causes.most_common()
    data.num_error_rows = sum(causes.values())
    return data


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass
class Cost:
    """What the generation cost at ``price_per_hour`` USD per GPU-hour (or accelerator-hour).

    Attributes:
        gpu_hours: generation seconds summed over the timelines (one GPU each: a run, shard or replica) / 3600;
            model loading is not counted.
        generated_tokens: generated tokens summed over the timelines.
    """

    price_per_hour: float
    gpu_hours: float
    generated_tokens: int

    @property
    def usd(self) -> float:
        return self.price_per_hour * self.gpu_hours

    @property
    def usd_per_million_tokens(self) -> float | None:
        return self.usd / self.generated_tokens * 1e6 if self.generated_tokens else None

    @property
    def gpu_hours_per_billion_tokens(self) -> float | None:
        return self.gpu_hours / self.generated_tokens * 1e9 if self.generated_tokens else None


def cost(timelines: list[Timeline], price_per_hour: float) -> Cost:
    """The ``Cost`` of the runs these timelines recorded."""
    return Cost(
        price_per_hour,
        sum(tl.duration_s for tl in timelines) / 3600,
        sum(tl.final("generated_tokens") for tl in timelines),
    )


@dataclass
class ReportData:
    """Everything ``cbrun report`` shows, read from one output directory."""

    output_dir: Path
    timelines: list[Timeline]
    rows: RowData
    stats: dict[str, Any] | None
    job: dict[str, Any] | None
    cost: Cost | None = None

    @property
    def generated_tokens(self) -> int:
        """Generated tokens over all the timelines (every run that recorded one)."""
        return sum(tl.final("generated_tokens") for tl in self.timelines)


def load_report_data(output_dir: str | Path, price_per_hour: float | None = None) -> ReportData:
    """Read an output directory for ``cbrun report``.

    Raises:
        FileNotFoundError: ``output_dir`` is not a cbrun output directory (no ``_cbrun/``).
    """
    output_dir = Path(output_dir)
    cbrun_dir = output_dir / "_cbrun"
    if not cbrun_dir.is_dir():
        raise FileNotFoundError(f"{output_dir} is not a cbrun output directory (it has no _cbrun/ folder)")
    timelines = load_timelines(cbrun_dir)
    data = ReportData(
        output_dir,
        timelines,
        load_rows(output_dir),
        read_json(cbrun_dir / "stats.json"),
        read_json(cbrun_dir / "job.json"),
    )
    if price_per_hour is not None:
        data.cost = cost(timelines, price_per_hour)
    return data
