"""A Ray replica's engine loop without Ray: two batches in flight share the engine's steps, and each batch's rows
equal the single-process run's (greedy rows and seeded sampled rows). Reading spans keeps exact row indices."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import run_job
from cbrun.jobs.run.replica import GROUP_SIZE_COLUMN, SHARED_STEPS_COLUMN, Replica
from cbrun.jobs.run.resources import open_reader

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=256, max_requests_per_batch=8, num_blocks=64, device="cpu")
MANIFEST_DEFAULTS = {"sampling": SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), "id_column": "id"}
NUM_ROWS = 40
KEY = ("row_index", "sample_index", "id", "completion_token_ids", "finish_reason")


def write_input(path) -> None:
    # Every third row is sampled (its temperature column) with a seed derived from the row id alone.
    pq.write_table(
        pa.table(
            {
                "id": [f"s{i}" for i in range(NUM_ROWS)],
                "prompt": [f"Once upon a time, {'Lily' if i % 2 else 'Tom'} saw {i}" for i in range(NUM_ROWS)],
                "temperature": pa.array([0.8 if i % 3 == 0 else None for i in range(NUM_ROWS)]),
            }
        ),
        path,
        row_group_size=7,
    )


def test_read_span_keeps_exact_row_indices_across_row_groups(stories260k_dir, make_manifest, tmp_path):
    write_input(tmp_path / "in.parquet")
    reader = open_reader(make_manifest(stories260k_dir, tmp_path / "in.parquet", tmp_path / "out"))
    span = pa.Table.from_batches(list(reader.read_span(5, 23)))  # starts and ends inside a row group
    rows = list(reader.rows_of(span.slice(3).to_batches()[0]))
    assert [(r.row_index, r.id) for r in rows] == [(i, f"s{i}") for i in range(8, 23)]
    assert rows[1].sampling_overrides == {"temperature": 0.8} and rows[0].sampling_overrides == {}


def test_two_batches_share_the_engine_steps_and_equal_the_single_process_run(stories260k_dir, make_manifest, tmp_path):
    write_input(tmp_path / "in.parquet")
    single = make_manifest(stories260k_dir, tmp_path / "in.parquet", tmp_path / "single", seed=5)
    run_job(single, progress=False)
    expected = {
        (r["row_index"], r["sample_index"]): tuple(r[k] for k in KEY)
        for r in read_output(tmp_path / "single").to_pylist()
    }

    replica = Replica(
        make_manifest(stories260k_dir, tmp_path / "in.parquet", tmp_path / "ray", seed=5),
        ENGINE_CONFIG,
        num_threads=1,
        max_concurrent_batches=2,
    )
    batches = [pa.Table.from_batches(list(replica.reader.read_span(start, start + 20))) for start in (0, 20)]

    async def both():
        return await asyncio.gather(*(replica(batch) for batch in batches))

    tables = asyncio.run(both())
    assert replica.loop.num_shared_steps > 0  # a forward pass ran rows of both batches
    assert all(sum(t.column(SHARED_STEPS_COLUMN).to_pylist()) > 0 for t in tables)  # each batch's rows took part
    for start, table in zip((0, 20), tables):
        assert table.column(GROUP_SIZE_COLUMN).to_pylist() == [1] * 20
        got = sorted(tuple(r[k] for k in KEY) for r in table.to_pylist())
        assert [g[0] for g in got] == list(range(start, start + 20))  # each batch gets back its own rows
        assert got == [expected[(i, 0)] for i in range(start, start + 20)]


def test_a_fault_fails_the_batches_held_and_the_loop_serves_the_next(stories260k_dir, make_manifest, tmp_path):
    write_input(tmp_path / "in.parquet")
    replica = Replica(
        make_manifest(stories260k_dir, tmp_path / "in.parquet", tmp_path / "ray"),
        ENGINE_CONFIG,
        num_threads=1,
        max_concurrent_batches=2,
    )
    batch = pa.Table.from_batches(list(replica.reader.read_span(0, 4)))
    step = replica.loop.engine.step
    replica.loop.engine.step = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        asyncio.run(replica(batch))
    replica.loop.engine.step = step
    table = asyncio.run(replica(batch))  # the same rows again (as Ray Data retries them): a clean engine and mode
    assert sorted(table.column("row_index").to_pylist()) == [0, 1, 2, 3]
