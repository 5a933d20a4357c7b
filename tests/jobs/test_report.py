"""cbrun report (jobs.observe.report*): the data behind each chart checked against the run's own stats; the page."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.cli import main
from cbrun.jobs.observe.report_data import cost, error_cause, load_report_data
from cbrun.jobs.run.job import run_job

pytest.importorskip("matplotlib")

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=64, max_requests_per_batch=4, num_blocks=64)
MANIFEST_DEFAULTS = {"sampling": SamplingParams(max_new_tokens=10, temperature=0.0), "commit_every_rows": 4}


@pytest.fixture
def finished_output(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    """A finished job of 20 rows (two of them error rows, one cause) run in two runs: its directory and stats."""
    prompts = [f"a shared prompt prefix of some length, row {i}" for i in range(20)]
    prompts[2] = prompts[11] = None
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "in.parquet")
    before = tiny_engine.stats
    for limit in (8, None):
        manifest = make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", limit=limit)
        manifest.output.timeline_interval_s = 0.001
        manifest.output.row_timings = True
        summary = run_job(manifest, progress=False, engine=tiny_engine)
    stats = json.loads((tmp_path / "out" / "_cbrun" / "stats.json").read_text())
    after = tiny_engine.stats
    stats["cached_prompt_tokens_both_runs"] = after.num_cached_prompt_tokens - before.num_cached_prompt_tokens
    stats["prompt_tokens_both_runs"] = after.num_prompt_tokens - before.num_prompt_tokens
    return tmp_path / "out", stats, summary


def test_the_charts_data_adds_up_to_the_runs_stats(finished_output):
    out, stats, last = finished_output
    data = load_report_data(out)
    rows = data.rows
    assert len(data.timelines) == 2  # the first run and the resumed one
    assert data.timelines[-1].final("generated_tokens") == last.num_generated_tokens == stats["num_generated_tokens"]
    # tokens/s chart: the rates integrate back to each run's generated tokens
    for timeline in data.timelines:
        t, rate = timeline.rate("generated_tokens")
        starts = [timeline.samples[0]["t"], *t[:-1]]
        integral = sum(r * (b - a) for r, a, b in zip(rate, starts, t))
        assert integral == pytest.approx(timeline.final("generated_tokens"))
    # distributions: every row of the output, error rows apart
    assert rows.num_rows == stats["total_output_rows"] == 20
    assert sum(rows.completion_tokens) == data.generated_tokens
    assert sum(rows.prompt_tokens) == sum(tl.final("prompt_tokens") for tl in data.timelines)
    assert len(rows.ttft_s) == len(rows.decode_s) == len(rows.queue_s) == 18
    # errors by cause: the two null prompts are one cause
    assert rows.errors == [("prompt column 'prompt' is null", 2)] and rows.num_error_rows == stats["total_error_rows"]
    # running / waiting and KV occupancy: within the engine's limits, and empty at the end
    for timeline in data.timelines:
        assert max(timeline.values("running")) <= 4
        assert all(0 <= v <= 1 for v in timeline.kv_occupancy()) and timeline.kv_occupancy()[-1] == 0
        t, hit_rate = timeline.ratio("cached_prompt_tokens", "prompt_tokens")
        assert t and all(0 <= v <= 1 for v in hit_rate)
    # prefix-cache hits over the runs equal the engine's own counts
    assert sum(tl.final("cached_prompt_tokens") for tl in data.timelines) == stats["cached_prompt_tokens_both_runs"]
    assert sum(tl.final("prompt_tokens") for tl in data.timelines) == stats["prompt_tokens_both_runs"]


def test_cost_per_million_tokens(finished_output):
    data = load_report_data(finished_output[0], price_per_hour=3.0)
    hours = sum(tl.duration_s for tl in data.timelines) / 3600
    assert data.cost.gpu_hours == pytest.approx(hours) and data.cost.generated_tokens == data.generated_tokens
    assert data.cost.usd_per_million_tokens == pytest.approx(3.0 * hours / data.generated_tokens * 1e6)
    assert data.cost.gpu_hours_per_billion_tokens == pytest.approx(hours / data.generated_tokens * 1e9)
    assert cost([], 3.0).usd_per_million_tokens is None


def test_the_page_is_self_contained(finished_output, capsys):
    out = finished_output[0]
    assert main(["report", str(out), "--price-per-hour", "2"]) == 0
    page = (out / "_cbrun" / "report.html").read_text()
    assert page.count("<svg") == 6  # tokens/s, requests, KV cache, prefix cache, distributions, errors
    assert "<script" not in page.lower() and not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    assert (
        "USD per million generated tokens" in page and "prompt column 'prompt' is null" in page
    )  # the errors chart's label
    pngs = sorted(p.name for p in (out / "_cbrun" / "report").iterdir())
    assert pngs == sorted(
        f"{name}.png" for name in ("tokens_per_s", "requests", "kv_cache", "prefix_cache", "distributions", "errors")
    )
    assert all((out / "_cbrun" / "report" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_report_out_and_errors(finished_output, tmp_path, capsys):
    target = tmp_path / "elsewhere" / "page.html"
    target.parent.mkdir()
    assert main(["report", str(finished_output[0]), "--out", str(target)]) == 0
    assert target.is_file() and (tmp_path / "elsewhere" / "page" / "errors.png").is_file()
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "not a cbrun output directory" in capsys.readouterr().err
    assert main(["report", str(finished_output[0]), "--price-per-hour", "-1"]) == 2


def test_error_causes_fall_together():
    assert error_cause(
        "row 4 (id 'r4'): the prompt has 301 tokens, but the model's maximum length is 256"
    ) == error_cause("row 9 (id 'x'): the prompt has 999 tokens, but the model's maximum length is 256")
    assert error_cause(None) == "(no message)"
    # numbers inside a word are part of the cause's name, not a count
    assert error_cause("row 3 (id '3', line 4 of in.jsonl): the line is not UTF-8 text (byte 0xff at offset 16)") == (
        "the line is not UTF-8 text (byte 0xff at offset N)"
    )
    assert error_cause("row 2 (custom_id 'q', line 3 of b.jsonl): body is not valid JSON") == "body is not valid JSON"
    assert error_cause("row 1 (id '1'): a float32 value") == "a float32 value"
    assert len(error_cause("row 1 (id 'a'): " + "x" * 200)) == 90


def test_an_output_without_timelines_still_has_its_rows_charts(finished_output):
    out = finished_output[0]
    for path in (out / "_cbrun").glob("timeline-*.jsonl"):
        path.unlink()
    assert main(["report", str(out)]) == 0
    page = (out / "_cbrun" / "report.html").read_text()
    assert page.count("<svg") == 2  # distributions and errors: the charts over time need a timeline
    assert 'Engine settings that ran</h2>\n<p class="sub">not recorded</p>' in page
