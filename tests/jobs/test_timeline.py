"""The run's timeline (jobs.observe.timeline), the per-row timing columns and the token ETA (jobs.observe.progress)."""

from __future__ import annotations

import itertools

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.observe.progress import MIN_FINISHED, TokenETA, format_eta
from cbrun.jobs.observe.timeline import TIMELINE_GLOB, read_timeline, step_listeners
from cbrun.jobs.output.lock import Shard
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import run_job

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=64, max_requests_per_batch=4, num_blocks=64)
MANIFEST_DEFAULTS = {"sampling": SamplingParams(max_new_tokens=12, temperature=0.0), "commit_every_rows": 5}
CUMULATIVE = (
    "rows_done",
    "rows_errors",
    "prompt_tokens",
    "cached_prompt_tokens",
    "generated_tokens",
    "computed_tokens",
    "steps",
    "offloads",
    "soft_resets",
    "failed_requests",
)


def write_prompts(path, n: int = 24):
    prompts = [f"the same long shared prefix for every row, then row {i}" for i in range(n)]
    prompts[3] = None  # an error row
    pq.write_table(pa.table({"prompt": prompts}), path, row_group_size=6)
    return path


def run(make_manifest, model_dir, tmp_path, engine, interval_s=0.001, output="out", row_timings=False, **settings):
    overwrite, shard = settings.pop("overwrite", False), settings.pop("shard", None)
    manifest = make_manifest(model_dir, write_prompts(tmp_path / "in.parquet"), tmp_path / output, **settings)
    manifest.output.timeline_interval_s = interval_s
    manifest.output.overwrite = overwrite
    manifest.output.row_timings = row_timings
    return manifest, run_job(manifest, progress=False, engine=engine, shard=shard)


def only_timeline(output_dir):
    paths = sorted((output_dir / "_cbrun").glob(TIMELINE_GLOB))
    assert len(paths) == 1, paths
    return paths[0], *read_timeline(paths[0])


def test_the_timeline_adds_up_to_the_runs_counts(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    steps_before = tiny_engine.stats.num_steps
    _, summary = run(make_manifest, tiny_model_dir, tmp_path, tiny_engine)
    _, header, samples = only_timeline(tmp_path / "out")
    assert header["engine"]["max_requests_per_batch"] == 4 and header["kv_blocks_total"] > 0
    final = samples[-1]
    assert final.get("final") and sum(bool(s.get("final")) for s in samples) == 1
    assert len(samples) > 3  # interval 1 ms: about a sample per step
    assert final["generated_tokens"] == summary.num_generated_tokens > 0
    assert final["prompt_tokens"] == summary.num_prompt_tokens
    assert (final["rows_done"], final["rows_errors"]) == (summary.num_rows, summary.num_errors) == (24, 1)
    assert final["steps"] == tiny_engine.stats.num_steps - steps_before
    assert sum(s["interval_steps"] for s in samples) == final["steps"]
    assert (final["running"], final["waiting"], final["kv_blocks_used"]) == (0, 0, 0)
    for before, after in itertools.pairwise(samples):
        assert after["t"] >= before["t"]
        for key in CUMULATIVE:
            assert after[key] >= before[key], key
    for sample in samples:
        assert sample["running"] <= 4 and 0 <= sample["kv_blocks_used"] <= header["kv_blocks_total"]
        assert sample["batch_tokens_max"] <= 64 and sample["batch_tokens_mean"] <= sample["batch_tokens_max"]
    assert max(s["running"] for s in samples) == 4  # the batch was full at some point
    assert tiny_engine.step_listener is None  # the run detached its listeners


def test_rows_carry_their_timings(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    run(make_manifest, tiny_model_dir, tmp_path, tiny_engine, output="plain")
    assert {r["ttft_s"] for r in read_output(tmp_path / "plain").to_pylist()} == {None}  # off by default
    _, summary = run(make_manifest, tiny_model_dir, tmp_path, tiny_engine, row_timings=True)
    rows = read_output(tmp_path / "out").to_pylist()
    assert len(rows) == 24
    for row in rows:
        if row["finish_reason"] == "error":
            assert (row["queue_s"], row["ttft_s"], row["decode_s"]) == (None, None, None)
            continue
        assert 0 <= row["queue_s"] <= row["ttft_s"] < summary.generation_s
        assert 0 <= row["decode_s"] < summary.generation_s
    # 4 requests at a time over 23 rows: later rows waited for a place in the batch
    assert max(r["queue_s"] or 0 for r in rows) > min(r["queue_s"] for r in rows if r["queue_s"] is not None)


def test_no_timeline_when_the_interval_is_zero(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    run(make_manifest, tiny_model_dir, tmp_path, tiny_engine, interval_s=0)
    assert not list((tmp_path / "out" / "_cbrun").glob(TIMELINE_GLOB))


def test_a_resumed_run_records_its_own_timeline(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    _, first = run(make_manifest, tiny_model_dir, tmp_path, tiny_engine, limit=10)
    _, second = run(make_manifest, tiny_model_dir, tmp_path, tiny_engine)
    timelines = [read_timeline(p) for p in sorted((tmp_path / "out" / "_cbrun").glob(TIMELINE_GLOB))]
    assert len(timelines) == 2
    assert sorted(s[-1]["generated_tokens"] for _, s in timelines) == sorted(
        [first.num_generated_tokens, second.num_generated_tokens]
    )
    assert sum(s[-1]["rows_done"] for _, s in timelines) == 24


def test_each_shard_records_its_own_timeline(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    totals = 0
    for index in range(2):
        _, summary = run(make_manifest, tiny_model_dir, tmp_path, tiny_engine, shard=Shard(index, 2))
        totals += summary.num_generated_tokens
    paths = sorted((tmp_path / "out" / "_cbrun").glob(TIMELINE_GLOB))
    assert [
        p.name.endswith(f"-shard-{i}-of-2.jsonl") for i, p in enumerate(sorted(paths, key=lambda p: p.name[-15:]))
    ] == [True, True]
    assert sum(read_timeline(p)[1][-1]["generated_tokens"] for p in paths) == totals


def test_overwrite_removes_the_old_timelines(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    run(make_manifest, tiny_model_dir, tmp_path, tiny_engine)
    run(
        make_manifest,
        tiny_model_dir,
        tmp_path,
        tiny_engine,
        overwrite=True,
        sampling=SamplingParams(max_new_tokens=5, temperature=0.0),
    )
    assert len(list((tmp_path / "out" / "_cbrun").glob(TIMELINE_GLOB))) == 1


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "timeline-x.jsonl"
    path.write_text('{"kind":"run","run":"x"}\n{"kind":"sample","t":0}\n{"kind":"sample","t":1')
    header, samples = read_timeline(path)
    assert header["run"] == "x" and samples == [{"kind": "sample", "t": 0}]
    (tmp_path / "bad.jsonl").write_text('{"kind":"sample","t":0}\n')
    with pytest.raises(ValueError, match="no header"):
        read_timeline(tmp_path / "bad.jsonl")


def test_step_listeners_call_each_in_turn():
    calls = []
    assert step_listeners(None, None) is None
    only = calls.append
    assert step_listeners(None, only) is only
    both = step_listeners(lambda t, s: calls.append(("a", t)), lambda t, s: calls.append(("b", s)))
    both(7, 0.5)
    assert calls == [("a", 7), ("b", 0.5)]


def test_the_eta_counts_tokens_not_rows():
    eta = TokenETA(num_rows=100)
    for _ in range(10):  # 10 rows read of 100: 20 prompt tokens and max_tokens 80 each
        eta.add_row([20], [80])
    assert eta.total_work() == 100 * (20 + 80)
    eta.observe(0, now=0.0)
    eta.observe(1000, now=1.0)  # 1000 tokens/s, no row finished yet
    assert eta.tokens_per_s() == 1000
    assert eta.eta_s() == pytest.approx((10_000 - 1000) / 1000)
    for _ in range(MIN_FINISHED):  # completions turn out to be 30 tokens: the estimate follows
        eta.finish_request(30)
    assert eta.expected_completion == 30
    assert eta.eta_s() == pytest.approx((100 * 50 - 1000) / 1000)


def test_the_eta_rate_forgets_old_history():
    eta = TokenETA(num_rows=1)
    eta.add_row([10], [10])
    for second in range(100):  # slow at first, then fast
        eta.observe(
            second * (10 if second < 50 else 0) + max(0, second - 50) * 1000 + 500 * (second >= 50), now=float(second)
        )
    assert eta.tokens_per_s() > 900
    assert format_eta(None) == "ETA ?" and format_eta(65) == "ETA 01:05" and format_eta(7384) == "ETA 2:03:04"


def test_a_ray_replica_records_its_own_timeline(stories260k_dir, tmp_path, make_manifest):
    import asyncio
    import time

    from cbrun.jobs.run.replica import Replica

    manifest = make_manifest(stories260k_dir, write_prompts(tmp_path / "in.parquet"), tmp_path / "out")
    manifest.output.timeline_interval_s = 0.001
    replica = Replica(manifest, ENGINE_CONFIG, num_threads=1, max_concurrent_batches=2)
    batches = [pa.Table.from_batches(list(replica.reader.read_span(start, start + 12))) for start in (0, 12)]

    async def both():
        return await asyncio.gather(*(replica(batch) for batch in batches))

    tables = asyncio.run(both())
    rows = [r for t in tables for r in t.to_pylist()]
    path = replica.timeline.path
    assert path.parent == tmp_path / "out" / "_cbrun" and "-replica-" in path.name
    deadline = time.monotonic() + 10
    while (samples := read_timeline(path)[1])[-1]["rows_done"] < 24 and time.monotonic() < deadline:
        time.sleep(0.05)  # the loop records its sample once idle, just after handing back the last batch
    last = samples[-1]
    assert (last["rows_done"], last["rows_errors"]) == (24, 1)
    assert last["generated_tokens"] == sum(r["num_completion_tokens"] for r in rows) > 0
    assert last["running"] == last["waiting"] == 0


@pytest.mark.parametrize(
    ("field", "value"), [("timeline_interval_s", -1), ("timeline_interval_s", True), ("row_timings", "yes")]
)
def test_bad_output_settings_are_refused(field, value):
    from cbrun.jobs.config.settings import OutputSettings

    with pytest.raises(ValueError, match=f"output.{field}"):
        OutputSettings(path="out", **{field: value})


def test_the_bar_shows_rows_eta_rate_and_errors(tiny_model_dir, tiny_engine, tmp_path, make_manifest, capsys):
    manifest = make_manifest(tiny_model_dir, write_prompts(tmp_path / "in.parquet"), tmp_path / "out")
    run_job(manifest, progress=True, engine=tiny_engine)
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "24/24 rows [" in last and ", ETA " in last and " gen tok/s, 1 error]" in last


def test_the_final_bar_counts_every_error_row():
    """Rows finishing within the postfix's 0.5 s refresh: the bar's last postfix still counts every error."""
    from types import SimpleNamespace

    from cbrun.jobs.observe.progress import JobProgress

    def row(reason):
        return SimpleNamespace(
            finish_reason=reason, num_completion_tokens=4, num_prompt_tokens=3, candidate_num_tokens=None
        )

    with JobProgress(3, None, enabled=False) as progress:
        progress.row_finished([row("stop")])
        progress.row_finished([row("error")])
        progress.row_finished([row("error")])
    assert progress.errors == 2 and progress.bar.postfix.endswith("2 errors")
