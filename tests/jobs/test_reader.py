"""Reader: streaming by record batches, prompt sources, per-row overrides, bad rows, resume skipping."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.reader import PromptReader, template_fields


def write(path, columns: dict, row_group_size: int = 3):
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


@pytest.fixture
def questions(tmp_path):
    n = 10
    return write(
        tmp_path / "q.parquet",
        {
            "id": [f"q{i}" for i in range(n)],
            "question": [f"question {i}" for i in range(n)],
            "answer": [f"answer {i}" for i in range(n)],
            "unused": list(range(n)),
        },
    )


def test_streams_every_row_in_order_over_row_groups_and_batches(questions, monkeypatch):
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("the reader must not load whole files"))
    reader = PromptReader(questions, prompt_column="question", id_column="id", batch_size=2)
    assert reader.num_rows == 10 and len(reader.sources[0].row_group_sizes) == 4
    assert reader.columns == ["id", "question"]  # only what the job needs
    rows = list(reader.iter_rows())
    assert [r.row_index for r in rows] == list(range(10))
    assert [r.id for r in rows] == [f"q{i}" for i in range(10)]
    assert rows[7].prompt == "question 7" and rows[7].error is None and rows[7].prompt_token_ids is None


def test_id_defaults_to_row_index_and_limit_cuts(questions):
    rows = list(PromptReader(questions, prompt_column="question", limit=4).iter_rows())
    assert [r.id for r in rows] == ["0", "1", "2", "3"]


def test_done_rows_are_skipped_and_fully_done_row_groups_not_read(questions, monkeypatch):
    reader = PromptReader(questions, prompt_column="question", batch_size=100)
    read_groups = []
    original = pq.ParquetFile.iter_batches

    def spy(self, *args, row_groups=None, **kwargs):
        read_groups.extend(row_groups)
        return original(self, *args, row_groups=row_groups, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    done = np.zeros(10, dtype=bool)
    done[[0, 1, 2, 4, 9]] = True  # row group 0 (rows 0-2) entirely done
    rows = list(reader.iter_rows(done))
    assert [r.row_index for r in rows] == [3, 5, 6, 7, 8]
    assert [r.prompt for r in rows] == [f"question {i}" for i in (3, 5, 6, 7, 8)]
    assert read_groups == [1, 2]  # row group 3 holds only row 9, done


def test_template_fills_columns(questions):
    rows = list(PromptReader(questions, template="Q: {question}\nA ({id}):", id_column="id").iter_rows())
    assert rows[2].prompt == "Q: question 2\nA (q2):"
    with pytest.raises(InputError, match="template field {missing}"):
        PromptReader(questions, template="{missing}")
    with pytest.raises(InputError, match="column names"):
        PromptReader(questions, template="{} and {0}")
    assert template_fields("{a.b} {c[0]} {a}") == ["a", "c"]


def test_template_null_field_is_a_row_error(tmp_path):
    path = write(tmp_path / "t.parquet", {"q": ["x", None], "c": ["ctx", "ctx"]})
    rows = list(PromptReader(path, template="{c}: {q}").iter_rows())
    assert rows[0].prompt == "ctx: x" and rows[0].error is None
    assert rows[1].error == "row 1 (id '1'): template field {q} is null"


def test_prompt_ids_column_is_used_as_given(tmp_path):
    path = write(tmp_path / "ids.parquet", {"ids": pa.array([[5, 6, 7], [], None, [1, None]], pa.list_(pa.int32()))})
    rows = list(PromptReader(path, prompt_ids_column="ids").iter_rows())
    assert rows[0].prompt_token_ids == [5, 6, 7] and rows[0].prompt is None
    assert "is empty" in rows[1].error and "is null" in rows[2].error and "null token id" in rows[3].error
    with pytest.raises(InputError, match="list of integers"):
        PromptReader(write(tmp_path / "bad.parquet", {"ids": ["1 2"]}), prompt_ids_column="ids")


def test_sampling_columns_override_per_row(tmp_path):
    path = write(
        tmp_path / "s.parquet",
        {
            "p": ["a", "b", "c", "d"],
            "temperature": [0.5, None, 1.0, 0.0],
            "max_new_tokens": pa.array([3, 4, None, 2], pa.int64()),
            "stop_token_ids": pa.array([[1, 2], None, [], [3]], pa.list_(pa.int64())),
            "ignore_eos": [True, None, False, None],
            "top_k": pa.array([1.0, 2.5, None, None], pa.float64()),
        },
    )
    reader = PromptReader(path, prompt_column="p")
    assert set(reader.sampling_columns) == {"temperature", "max_new_tokens", "stop_token_ids", "ignore_eos", "top_k"}
    rows = list(reader.iter_rows())
    assert rows[0].sampling_overrides == {
        "temperature": 0.5,
        "max_new_tokens": 3,
        "stop_token_ids": (1, 2),
        "ignore_eos": True,
        "top_k": 1,
    }
    assert rows[1].error == "row 1 (id '1'): top_k must be an integer, got 2.5"
    assert rows[2].sampling_overrides == {"temperature": 1.0, "stop_token_ids": (), "ignore_eos": False}
    assert rows[3].sampling_overrides == {"temperature": 0.0, "max_new_tokens": 2, "stop_token_ids": (3,)}


def test_stop_strings_column(tmp_path):
    path = write(tmp_path / "s.parquet", {"p": ["a", "b", "c"], "stop": pa.array([["\n", "END"], [], None])})
    rows = list(PromptReader(path, prompt_column="p").iter_rows())
    assert [r.sampling_overrides for r in rows] == [{"stop": ("\n", "END")}, {"stop": ()}, {}]
    path = write(tmp_path / "t.parquet", {"p": ["a", "b"], "stop": ["\n", None]})
    assert [r.sampling_overrides for r in PromptReader(path, prompt_column="p").iter_rows()] == [{"stop": ("\n",)}, {}]


def test_bad_per_row_value_type_is_a_row_error(tmp_path):
    path = write(tmp_path / "s.parquet", {"p": ["a", "b"], "temperature": ["hot", None]})
    rows = list(PromptReader(path, prompt_column="p").iter_rows())
    assert "temperature must be a number, got 'hot'" in rows[0].error and rows[1].error is None


def test_null_empty_and_undecodable_prompts_are_row_errors(tmp_path):
    path = write(
        tmp_path / "p.parquet",
        {"id": ["a", "b", "c", None], "p": pa.array([b"ok", None, b"", b"\xff\xfe bad"], pa.binary())},
    )
    rows = list(PromptReader(path, prompt_column="p", id_column="id").iter_rows())
    assert rows[0].prompt == "ok" and rows[0].error is None
    assert rows[1].error == "row 1 (id 'b'): prompt column 'p' is null"
    assert rows[2].error == "row 2 (id 'c'): prompt column 'p' is empty"
    assert rows[3].error.startswith("row 3 (id '3'): id column 'id' is null")
    path = write(tmp_path / "u.parquet", {"p": pa.array([b"fine", b"\xff\xfe bad"], pa.binary())})
    rows = list(PromptReader(path, prompt_column="p").iter_rows())
    assert rows[0].error is None and "not valid UTF-8" in rows[1].error


def test_string_column_with_invalid_utf8_fails_only_its_row(tmp_path):
    # A string array over raw bytes that are not UTF-8, as a foreign writer could produce.
    array = pa.array([b"good", b"\xc3\x28"], pa.binary()).view(pa.string())
    batch = pa.record_batch({"p": array})
    reader = PromptReader(write(tmp_path / "x.parquet", {"p": ["a", "b"]}), prompt_column="p")
    rows = list(reader._batch_rows(0, batch, np.zeros(2, dtype=bool)))
    assert rows[0].prompt == "good" and rows[1].error.startswith("row 1 (id '1'): prompt column 'p' cannot be read")


def test_missing_input_and_missing_column_raise_before_reading(tmp_path, questions):
    with pytest.raises(InputError, match="not found"):
        PromptReader(tmp_path / "nope.parquet", prompt_column="q")
    with pytest.raises(InputError, match=r"input.prompt_column 'prompt' is not a column .*question"):
        PromptReader(questions, prompt_column="prompt")
    with pytest.raises(InputError, match="input.id_column 'key'"):
        PromptReader(questions, prompt_column="question", id_column="key")
    with pytest.raises(InputError, match="must hold text"):
        PromptReader(questions, prompt_column="unused")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no .parquet files"):
        PromptReader(tmp_path / "empty", prompt_column="q")


def test_directory_input_numbers_rows_across_files(tmp_path):
    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / "b.parquet", {"p": ["b0", "b1", "b2", "b3"]})
    write(tmp_path / "d" / "a.parquet", {"p": ["a0", "a1"]})
    (tmp_path / "d" / ".hidden.parquet").write_bytes(b"not parquet")
    reader = PromptReader(tmp_path / "d", prompt_column="p", batch_size=3)
    assert reader.num_rows == 6
    done = np.zeros(6, dtype=bool)
    done[[0, 1, 3]] = True  # file a entirely done
    assert [(r.row_index, r.prompt) for r in reader.iter_rows(done)] == [(2, "b0"), (4, "b2"), (5, "b3")]
    assert [r.prompt for r in PromptReader(tmp_path / "d", prompt_column="p", limit=3).iter_rows()] == [
        "a0",
        "a1",
        "b0",
    ]


def test_saved_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(25)], "temperature": [0.5] * 25})
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    reader = PromptReader(tmp_path / "ds", prompt_column="text", batch_size=4)
    assert len(reader.sources) > 1 and reader.num_rows == 25
    done = np.zeros(25, dtype=bool)
    done[:10] = True
    rows = list(reader.iter_rows(done))
    assert [r.prompt for r in rows] == [f"t{i}" for i in range(10, 25)]
    assert rows[0].sampling_overrides == {"temperature": 0.5}
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match="DatasetDict.*test"):
        PromptReader(tmp_path / "dd", prompt_column="text")


@pytest.mark.parametrize("text", [pa.string(), pa.large_string(), pa.string_view()])
def test_every_arrow_text_type_is_a_prompt_and_setting_column(tmp_path, text):
    # Newer pyarrow, polars and duckdb write string_view; it must read as string does.
    path = write(
        tmp_path / "v.parquet",
        {
            "p": pa.array(["a", "b", None], text),
            "stop": pa.array([["END"], None, []], pa.list_(text)),
            "logprobs_mode": pa.array(["processed_logprobs", None, None], text),
        },
    )
    assert pq.read_schema(path).field("p").type == text
    rows = list(PromptReader(path, prompt_column="p").iter_rows())
    assert [r.prompt for r in rows[:2]] == ["a", "b"] and rows[2].error is not None
    assert rows[0].sampling_overrides == {"stop": ("END",), "logprobs_mode": "processed_logprobs"}
    assert rows[1].sampling_overrides == {}
