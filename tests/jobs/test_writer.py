"""Writer: one schema, atomic commits under temporary names, commit thresholds, part numbering."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from cbrun.jobs.output import writer as writer_module
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.output.writer import OUTPUT_SCHEMA, OutputRow, PartWriter, committed_parts, part_name
from cbrun.jobs.store import files as storage_module


def make_row(i: int, error: bool = False) -> OutputRow:
    if error:
        return OutputRow(
            id=f"r{i}",
            row_index=i,
            completion=None,
            completion_token_ids=[],
            num_prompt_tokens=0,
            num_completion_tokens=0,
            finish_reason="error",
            error=f"row {i}: bad",
        )
    return OutputRow(
        id=f"r{i}",
        row_index=i,
        completion=f"text {i}",
        completion_token_ids=[i, i + 1],
        num_prompt_tokens=3,
        num_completion_tokens=2,
        finish_reason="length",
    )


def test_parts_have_the_schema_and_rows(tmp_path):
    writer = PartWriter(tmp_path, commit_every_rows=100)
    writer.add(make_row(0))
    writer.add(make_row(1, error=True))
    path = writer.commit()
    assert path.name == "part-000000.parquet"
    table = pq.read_table(path)
    assert table.schema.equals(OUTPUT_SCHEMA)
    unset = {
        "logprobs": None,
        "prompt_logprobs": None,
        "prompt_greedy": None,
        "stop_reason": None,
        "candidate_logprobs": None,
        "candidate_num_tokens": None,
        "candidate_is_greedy": None,
        "sample_index": 0,
        "queue_s": None,
        "ttft_s": None,
        "decode_s": None,
        "structured_output_valid": None,
    }
    assert table.to_pylist() == [
        {
            "id": "r0",
            "row_index": 0,
            "completion": "text 0",
            "completion_token_ids": [0, 1],
            "num_prompt_tokens": 3,
            "num_completion_tokens": 2,
            "finish_reason": "length",
            "error": None,
            **unset,
        },
        {
            "id": "r1",
            "row_index": 1,
            "completion": None,
            "completion_token_ids": [],
            "num_prompt_tokens": 0,
            "num_completion_tokens": 0,
            "finish_reason": "error",
            "error": "row 1: bad",
            **unset,
        },
    ]
    assert writer.commit() is None  # nothing buffered


def test_commit_writes_a_hidden_temp_file_then_renames(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((os.path.basename(src), os.path.basename(dst), sorted(os.listdir(tmp_path))))
        assert pq.read_table(src).num_rows == 1  # complete and readable before it gets its final name
        real_replace(src, dst)

    monkeypatch.setattr(storage_module.os, "replace", spy)
    writer = PartWriter(tmp_path)
    writer.add(make_row(0))
    writer.commit()
    temp = f".part-000000.parquet.{os.getpid()}.tmp"
    assert seen == [(temp, "part-000000.parquet", [temp])]
    assert sorted(os.listdir(tmp_path)) == ["part-000000.parquet"]


def test_temp_files_are_not_committed_parts(tmp_path):
    (tmp_path / ".part-000003.parquet.tmp").write_bytes(b"half written")
    (tmp_path / "part-000001.parquet").write_bytes(b"")
    (tmp_path / "part-000000.parquet").write_bytes(b"")
    (tmp_path / "notes.parquet").write_bytes(b"")
    assert [p.name for p in committed_parts(tmp_path)] == ["part-000000.parquet", "part-000001.parquet"]
    assert PartWriter(tmp_path).next_part == 2  # numbering continues after committed parts


def test_commit_every_rows(tmp_path):
    writer = PartWriter(tmp_path, commit_every_rows=3, commit_every_seconds=1e9)
    for i in range(7):
        writer.add(make_row(i))
    assert [p.name for p in committed_parts(tmp_path)] == [part_name(0), part_name(1)]
    assert len(writer.buffer) == 1 and writer.num_committed_rows == 6
    writer.commit()
    assert [pq.read_table(p).column("row_index").to_pylist() for p in committed_parts(tmp_path)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6],
    ]


def test_commit_every_seconds(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(writer_module.time, "monotonic", lambda: now[0])
    writer = PartWriter(tmp_path, commit_every_rows=1000, commit_every_seconds=30)
    writer.add(make_row(0))
    now[0] += 10
    writer.add(make_row(1))
    assert not writer.maybe_commit() and committed_parts(tmp_path) == []
    now[0] += 20  # the oldest buffered row is 30 s old
    assert writer.maybe_commit()
    assert pq.read_table(committed_parts(tmp_path)[0]).num_rows == 2


def test_output_row_checks_its_finish_reason():
    with pytest.raises(AssertionError):
        OutputRow(
            id="x",
            row_index=0,
            completion="",
            completion_token_ids=[],
            num_prompt_tokens=1,
            num_completion_tokens=0,
            finish_reason="error",
            error=None,
        )


def test_read_output_reads_committed_parts_only(tmp_path):
    assert read_output(tmp_path).num_rows == 0
    writer = PartWriter(tmp_path, commit_every_rows=2)
    for i in range(5):
        writer.add(make_row(i))
    writer.commit()
    (tmp_path / "job.json").write_text("{}")
    (tmp_path / ".part-000009.parquet.tmp").write_bytes(b"half")
    table = read_output(tmp_path, columns=["row_index"])
    assert sorted(table.column("row_index").to_pylist()) == [0, 1, 2, 3, 4]


def test_logprob_columns_round_trip(tmp_path):
    row = make_row(0)
    row.logprobs = [{5: -0.25, 9: -1.5}, {7: -0.5}]
    row.prompt_logprobs, row.prompt_greedy = [-2.0, -0.5], [False, True]
    writer = PartWriter(tmp_path)
    writer.add(row)
    stored = pq.read_table(writer.commit()).to_pylist()[0]
    assert stored["logprobs"][1] == [{"token_id": 7, "logprob": -0.5}]  # lists of structs, not maps
    assert [{e["token_id"]: e["logprob"] for e in step} for step in stored["logprobs"]] == row.logprobs
    assert (stored["prompt_logprobs"], stored["prompt_greedy"]) == ([-2.0, -0.5], [False, True])


def test_read_output_returns_every_column_of_the_parts_the_carried_ones_too(tmp_path):
    import pyarrow as pa

    writer = PartWriter(tmp_path, carried_fields=[pa.field("topic", pa.string())])
    row = make_row(0)
    row.carried = {"topic": "maths"}
    writer.add(row)
    writer.commit()
    table = read_output(tmp_path)
    assert table.column_names == [*OUTPUT_SCHEMA.names, "topic"]
    assert table.column("topic").to_pylist() == ["maths"]
    assert read_output(tmp_path, columns=["row_index", "topic"]).to_pylist() == [{"row_index": 0, "topic": "maths"}]
