"""``cbrun report OUT``: one self-contained HTML page of a job's output, and PNG copies of its charts.

The page holds its charts as inline SVG and its tables as plain HTML: no JavaScript, no stylesheet or font to
fetch, so it opens offline and can be mailed or archived as one file. The numbers come from ``cbrun.jobs.observe.report_data``,
the charts from ``cbrun.jobs.observe.report_charts`` (matplotlib, the extra ``cbrun[report]``, imported only here)::

    OUT/_cbrun/timeline-*.jsonl, stats.json, job.json, part-*.parquet
        -> report_data.load_report_data -> report_charts.CHARTS -> OUT/_cbrun/report.html
                                                                   OUT/_cbrun/report/<chart>.png
"""

from __future__ import annotations

import html
import io
from pathlib import Path
from typing import Any

from cbrun.jobs.observe.report_data import ReportData, load_report_data

REPORT_EXTRA_MESSAGE = (
    "cbrun report draws its charts with matplotlib, which is not installed: pip install 'cbrun[report]'"
)

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 960px;
       color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.sub { color: #666; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
td, th { border-bottom: 1px solid #ddd; padding: 3px 12px 3px 0; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.charts svg { width: 100%; height: auto; display: block; margin: 10px 0; }
.cols { display: flex; gap: 32px; flex-wrap: wrap; }
code { font-size: 12px; }
"""


def check_matplotlib() -> None:
    """Raise ``ImportError`` with ``REPORT_EXTRA_MESSAGE`` when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(REPORT_EXTRA_MESSAGE) from None


def write_report(output_dir: str | Path, out: str | Path | None = None, price_per_hour: float | None = None) -> Path:
    """Write the report of ``output_dir`` (a finished or running job's output) and its charts' PNG copies.

    Args:
        output_dir: the job's output directory.
        out: the HTML file to write; None: ``output_dir/_cbrun/report.html``. The PNGs go in ``<out stem>/``
            beside it (``_cbrun/report/``).
        price_per_hour: USD per GPU-hour; given, the page says what a million generated tokens cost.

    Returns:
        The HTML file's path.

    Raises:
        FileNotFoundError: ``output_dir`` is not a cbrun output directory.
        ImportError: matplotlib is not installed (``REPORT_EXTRA_MESSAGE``).
    """
    check_matplotlib()
    data = load_report_data(output_dir, price_per_hour)
    out = Path(out) if out is not None else data.output_dir / "_cbrun" / "report.html"
    png_dir = out.with_suffix("")
    png_dir.mkdir(parents=True, exist_ok=True)
    charts = render_charts(data, png_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(render_html(data, charts), encoding="utf-8")
    tmp.replace(out)
    return out


def render_charts(data: ReportData, png_dir: Path) -> list[str]:
    """Each chart that has data as an inline ``<svg>`` string, its PNG saved in ``png_dir``."""
    import matplotlib

    from cbrun.jobs.observe.report_charts import CHARTS

    svgs = []
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "cbrun", "font.size": 9}):
        for name, chart in CHARTS:
            fig = chart(data)
            if fig is None:
                continue
            fig.savefig(png_dir / f"{name}.png", format="png", dpi=100, metadata={"Software": None})
            buffer = io.StringIO()
            fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
            text = buffer.getvalue()
            svgs.append(text[text.index("<svg") :])  # NOTE: inline SVG takes no XML declaration or DOCTYPE
    return svgs


def summary_rows(data: ReportData) -> list[tuple[str, str]]:
    """The summary table: (what, value)."""
    rows, stats, timelines = data.rows, data.stats or {}, data.timelines
    seconds = sum(tl.duration_s for tl in timelines)
    generated = data.generated_tokens
    table = [
        ("status", "finished (_SUCCESS)" if (data.output_dir / "_SUCCESS").is_file() else "not finished"),
        ("output rows", f"{rows.num_rows:,}"),
        ("error rows", f"{rows.num_error_rows:,}"),
        ("prompt tokens (rows without errors)", f"{sum(rows.prompt_tokens):,}"),
        ("generated tokens (rows without errors)", f"{sum(rows.completion_tokens):,}"),
        ("runs recorded (timelines)", f"{len(timelines)}"),
        ("generation time over the runs", f"{seconds:,.1f} s"),
        ("generated tokens over the runs", f"{generated:,}"),
    ]
    if early := [tl.label for tl in timelines if tl.ends_early]:
        table.append(
            (
                "runs whose timeline ends early",
                f"{len(early)} ({', '.join(early)}): killed or still running; their figures stop at their last commit",
            )
        )
    if seconds:
        table.append(("generated tokens per second", f"{generated / seconds:,.0f}"))
    if data.rows.ttft_s:
        table.append(("median time to first token", f"{_median(rows.ttft_s):.3f} s"))
    if timelines:

        def total(key: str) -> int:
            return sum(tl.final(key) for tl in timelines)

        prompt, proposed = total("prompt_tokens"), total("spec_proposed")
        hit_rate = total("cached_prompt_tokens") / prompt if prompt else 0.0
        table += [
            ("prefix-cache hit rate (of prompt tokens)", f"{100 * hit_rate:.1f}%"),
            ("offloads / soft resets", f"{total('offloads')} / {total('soft_resets')}"),
        ]
        if proposed:
            table.append(
                ("speculative proposals accepted", f"{100 * total('spec_accepted') / proposed:.1f}% of {proposed:,}")
            )
    if stats.get("peak_memory_mib"):
        table.append(("peak memory (last run)", f"{stats['peak_memory_mib']:,.0f} MiB"))
    return table


def cost_rows(data: ReportData) -> list[tuple[str, str]]:
    """The cost table (empty without ``--price-per-hour``)."""
    cost = data.cost
    if cost is None:
        return []
    per_million, per_billion = cost.usd_per_million_tokens, cost.gpu_hours_per_billion_tokens
    return [
        ("price", f"{cost.price_per_hour:g} USD per GPU-hour"),
        ("GPU-hours (generation, summed over runs, shards and replicas)", f"{cost.gpu_hours:.4f}"),
        ("cost of the generation", f"{cost.usd:.4f} USD"),
        ("USD per million generated tokens", "n/a" if per_million is None else f"{per_million:.4f}"),
        ("GPU-hours per billion generated tokens", "n/a" if per_billion is None else f"{per_billion:,.1f}"),
    ]


def settings_rows(data: ReportData) -> list[tuple[str, str]]:
    """The engine settings of the latest run that recorded a timeline."""
    if not data.timelines:
        return []
    header = data.timelines[-1].header
    engine = header.get("engine") or {}
    return [
        ("run", str(header.get("run"))),
        ("started", str(header.get("started_at"))),
        ("KV-cache blocks", str(header.get("kv_blocks_total"))),
    ] + [(k, str(v)) for k, v in engine.items()]


def fingerprint_rows(data: ReportData) -> list[tuple[str, str]]:
    """Model and input: paths and content hashes from ``_cbrun/job.json``, and the sampling settings."""
    job = data.job or {}
    model, inp = job.get("model") or {}, job.get("input") or {}
    rows = [("model", str(model.get("path"))), ("dtype", str(model.get("dtype")))]
    for group in ("weights", "files"):
        rows += [(f"model {name}", _short(digest)) for name, digest in (model.get(group) or {}).items()]
    rows += [("input", str(inp.get("path"))), ("input rows", str(inp.get("num_rows")))]
    rows += [(f"input {name}", _short(digest)) for name, digest in (inp.get("files") or {}).items()]
    sampling = job.get("sampling") or {}
    rows += [(f"sampling {k}", str(v)) for k, v in sampling.items() if v not in (None, [], 0.0, False)]
    return rows


def render_html(data: ReportData, charts: list[str]) -> str:
    """The page: title, tables, then the charts (inline SVG)."""
    title = f"cbrun report: {data.output_dir.name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<div class="sub">{html.escape(str(data.output_dir.resolve()))}</div>',
        '<div class="cols"><div>',
        "<h2>Summary</h2>",
        _table(summary_rows(data)),
    ]
    if data.cost is not None:
        parts += ["<h2>Cost</h2>", _table(cost_rows(data))]
    parts += [
        "</div><div>",
        "<h2>Model and input</h2>",
        _table(fingerprint_rows(data)),
        "</div></div>",
        '<h2>Over time</h2><div class="charts">',
        *charts,
        "</div>",
        "<h2>Engine settings that ran</h2>",
        _table(settings_rows(data)),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _table(rows: list[tuple[str, Any]]) -> str:
    if not rows:
        return '<p class="sub">not recorded</p>'
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _short(digest: str) -> str:
    return f"{digest[:16]}…" if isinstance(digest, str) and len(digest) > 16 else str(digest)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
