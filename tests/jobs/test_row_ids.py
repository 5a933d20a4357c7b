"""The repeated-id count is recorded in the output with the input's fingerprint: shards and reruns of the same
input read it instead of the id column; another input (or limit) is counted again."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.output import row_ids


def test_the_count_is_read_back_for_the_same_input_and_recounted_for_another(tmp_path, monkeypatch):
    pq.write_table(pa.table({"id": ["a", "b", "a", "c", "b", "a"], "prompt": list("pqrstu")}), tmp_path / "in.parquet")
    counted = []
    count = row_ids.repeated_ids
    monkeypatch.setattr(row_ids, "repeated_ids", lambda reader: counted.append(reader.num_rows) or count(reader))
    reader = PromptReader(tmp_path / "in.parquet", prompt_column="prompt", id_column="id")
    expected = (2, [("a", 3), ("b", 2)])
    assert row_ids.recorded_repeated_ids(reader, tmp_path / "out", {"files": "x"}) == expected
    assert row_ids.recorded_repeated_ids(reader, tmp_path / "out", {"files": "x"}) == expected  # another shard
    assert counted == [6]
    assert row_ids.recorded_repeated_ids(reader, tmp_path / "out", {"files": "y"}) == expected  # input changed
    limited = PromptReader(tmp_path / "in.parquet", prompt_column="prompt", id_column="id", limit=2)
    assert row_ids.recorded_repeated_ids(limited, tmp_path / "out", {"files": "y"}) == (0, [])
    assert counted == [6, 6, 2]
