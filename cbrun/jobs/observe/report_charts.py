"""The charts of ``cbrun report``, drawn with matplotlib (the extra ``cbrun[report]``) from ``cbrun.jobs.observe.report_data``.

Each chart function takes the ``ReportData`` and returns a matplotlib ``Figure`` (or None when there is nothing to
draw); ``CHARTS`` lists them in page order. Over time, each timeline (a run, a shard, a Ray replica) is one line, so
a sharded or Ray job shows each share of the work side by side.
"""

from __future__ import annotations

from cbrun.jobs.observe.report_data import ReportData

#: Figure size in inches of one chart (the page is about 1000 px wide).
WIDE = (9.0, 3.0)


def _figure(size=WIDE):
    # NOTE: a Figure, not pyplot: no GUI backend, no global state
    from matplotlib.figure import Figure

    return Figure(figsize=size, dpi=100, layout="constrained")


def _over_time(data: ReportData, title: str, ylabel: str, series) -> object | None:
    """A line per timeline of ``series(timeline) -> (t, y)``; None when no timeline has a point."""
    fig = _figure()
    ax = fig.add_subplot()
    drawn = False
    for timeline in data.timelines:
        t, y = series(timeline)
        if t:
            ax.plot(t, y, label=timeline.label, linewidth=1.2)
            drawn = True
    if not drawn:
        return None
    ax.set_title(title, loc="left", fontsize=11)
    ax.set_xlabel("seconds since the run's start")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(data.timelines) > 1:
        ax.legend(fontsize=8, loc="best")
    return fig


def generated_tokens_per_s(data: ReportData):
    return _over_time(data, "Generated tokens per second", "tokens/s", lambda tl: tl.rate("generated_tokens"))


def requests_in_engine(data: ReportData):
    """Running (solid) and waiting (dashed) requests, per timeline."""
    fig = _figure()
    ax = fig.add_subplot()
    for i, timeline in enumerate(data.timelines):
        color = f"C{i % 10}"
        suffix = f" ({timeline.label})" if len(data.timelines) > 1 else ""
        ax.plot(timeline.times(), timeline.values("running"), color=color, label=f"running{suffix}")
        ax.plot(timeline.times(), timeline.values("waiting"), color=color, linestyle="--", label=f"waiting{suffix}")
    if not data.timelines:
        return None
    ax.set_title("Requests running (in the batch) and waiting", loc="left", fontsize=11)
    ax.set_xlabel("seconds since the run's start")
    ax.set_ylabel("requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig


def kv_cache_occupancy(data: ReportData):
    return _over_time(
        data, "KV-cache occupancy", "% of blocks in use", lambda tl: (tl.times(), [100 * v for v in tl.kv_occupancy()])
    )


def prefix_cache_hit_rate(data: ReportData):
    def series(timeline):
        t, y = timeline.ratio("cached_prompt_tokens", "prompt_tokens")
        return t, [100 * v for v in y]

    return _over_time(
        data,
        "Prefix-cache hit rate (prompt tokens of the requests finished in each interval)",
        "% of prompt tokens",
        series,
    )


def distributions(data: ReportData):
    """Histograms of prompt and completion lengths, time to first token and per-row decode time."""
    rows = data.rows
    panels = [
        ("Prompt length", "tokens", rows.prompt_tokens),
        ("Completion length", "tokens", rows.completion_tokens),
        ("Time to first token", "seconds", rows.ttft_s),
        ("Decode time per row", "seconds", rows.decode_s),
    ]
    if not any(values for _, _, values in panels):
        return None
    fig = _figure((9.0, 5.0))
    for ax, (title, unit, values) in zip(fig.subplots(2, 2).flat, panels):
        ax.set_title(f"{title} ({len(values)} rows)", loc="left", fontsize=10)
        ax.set_xlabel(unit)
        if values:
            ax.hist(values, bins=min(40, max(5, len(set(values)))), color="C0", alpha=0.85)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    return fig


def errors_by_cause(data: ReportData):
    errors = data.rows.errors[:12]
    if not errors:
        return None
    fig = _figure((9.0, 0.6 + 0.35 * len(errors)))
    ax = fig.add_subplot()
    causes = [cause for cause, _ in errors][::-1]
    ax.barh(range(len(causes)), [count for _, count in errors][::-1], color="C3")
    ax.set_yticks(range(len(causes)), causes, fontsize=8)
    ax.set_xlabel("error rows")
    ax.set_title(
        f"Error rows by cause ({data.rows.num_error_rows} of {data.rows.num_rows} output rows)", loc="left", fontsize=11
    )
    return fig


#: (file stem, chart function), in page order.
CHARTS = [
    ("tokens_per_s", generated_tokens_per_s),
    ("requests", requests_in_engine),
    ("kv_cache", kv_cache_occupancy),
    ("prefix_cache", prefix_cache_hit_rate),
    ("distributions", distributions),
    ("errors", errors_by_cause),
]
