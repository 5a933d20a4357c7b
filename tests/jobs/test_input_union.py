"""Issue 14 §2: inputs read as written: dictionary-encoded text, the union of the files' schemas (missing = null,
both file orders), types that cannot be unified named by file, and a file whose prompt column is all null."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.input.schema_union import conform_batch, unify_schemas
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import JobError, run_job

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=256, max_requests_per_batch=8, num_blocks=64)


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from cbrun.engine import LLMEngine

    return LLMEngine.from_pretrained(str(tiny_model_dir), ENGINE_CONFIG)


def job(model_dir, input_path, output_dir, **input_settings) -> JobManifest:
    return JobManifest(
        model=ModelSettings(path=str(model_dir)),
        input=InputSettings(path=str(input_path), **{"prompt_column": "p", **input_settings}),
        sampling=SamplingParams(max_new_tokens=5),
        engine=ENGINE_CONFIG,
        output=OutputSettings(path=str(output_dir)),
    )


def rows_of(output_dir) -> list[dict]:
    return read_output(output_dir).sort_by("row_index").to_pylist()


def test_a_pandas_categorical_column_is_text(tmp_path):
    frame = pd.DataFrame({"p": pd.Categorical(["red", "blue", "red", None]), "tag": pd.Categorical(["x"] * 4)})
    frame.to_parquet(tmp_path / "cat.parquet")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "cat.parquet").field("p").type)
    reader = PromptReader(tmp_path / "cat.parquet", template="{p}/{tag}")
    assert [(r.prompt, r.error) for r in reader.iter_rows()] == [
        ("red/x", None),
        ("blue/x", None),
        ("red/x", None),
        (None, "row 3 (id '3'): template field {p} is null"),
    ]
    reader = PromptReader(tmp_path / "cat.parquet", prompt_column="p", id_column="tag")
    assert [r.prompt for r in reader.iter_rows()][:3] == ["red", "blue", "red"] and reader.schema.field(
        "p"
    ).type == pa.string()


@pytest.mark.parametrize("per_row_file_first", [True, False])
def test_files_with_different_columns_read_as_their_union(tiny_model_dir, tiny_engine, tmp_path, per_row_file_first):
    directory = tmp_path / "in"
    directory.mkdir()
    with_column, without = ("part-0", "part-1") if per_row_file_first else ("part-1", "part-0")
    pq.write_table(pa.table({"p": ["a", "b"], "max_new_tokens": [1, 2]}), directory / f"{with_column}.parquet")
    pq.write_table(pa.table({"p": ["c", "d"]}), directory / f"{without}.parquet")
    reader = PromptReader(directory, prompt_column="p")
    assert reader.sampling_columns == ["max_new_tokens"]
    by_prompt = {r.prompt: r.sampling_overrides for r in reader.iter_rows()}
    assert by_prompt == {"a": {"max_new_tokens": 1}, "b": {"max_new_tokens": 2}, "c": {}, "d": {}}
    summary = run_job(job(tiny_model_dir, directory, tmp_path / "out"), progress=False, engine=tiny_engine)
    assert (summary.num_rows, summary.num_errors) == (4, 0)
    lengths = {r["row_index"]: r["num_completion_tokens"] for r in rows_of(tmp_path / "out")}
    first = 0 if per_row_file_first else 2  # rows of the file with the column: its values; the others: the job's 5
    assert lengths == {first: 1, first + 1: 2, 2 - first: 5, 3 - first: 5}


def test_types_that_cannot_unify_name_the_files(tmp_path):
    directory = tmp_path / "in"
    directory.mkdir()
    pq.write_table(pa.table({"p": ["a"], "id": ["x"], "note": ["n"]}), directory / "a.parquet")
    pq.write_table(pa.table({"p": ["b"], "id": [7], "note": [1]}), directory / "b.parquet")
    with pytest.raises(
        InputError,
        match=r"column 'id' has types that cannot be read as one across the input's "
        r"files: string in '.*a.parquet'; int64 in '.*b.parquet'",
    ):
        PromptReader(directory, prompt_column="p", id_column="id")
    # columns the job does not read may clash: they are never read
    assert [r.prompt for r in PromptReader(directory, prompt_column="p").iter_rows()] == ["a", "b"]


def test_widened_types_read_as_one(tmp_path):
    directory = tmp_path / "in"
    directory.mkdir()
    pq.write_table(pa.table({"p": ["a"], "top_k": pa.array([1], pa.int32())}), directory / "a.parquet")
    pq.write_table(
        pa.table({"p": pa.array(["b"], pa.large_string()), "top_k": pa.array([2], pa.int64())}), directory / "b.parquet"
    )
    reader = PromptReader(directory, prompt_column="p")
    assert reader.schema.field("top_k").type == pa.int64()
    assert [(r.prompt, r.sampling_overrides) for r in reader.iter_rows()] == [("a", {"top_k": 1}), ("b", {"top_k": 2})]


def test_a_file_whose_prompt_column_is_all_null_gives_error_rows(tiny_model_dir, tiny_engine, tmp_path):
    directory = tmp_path / "in"
    directory.mkdir()
    pq.write_table(pa.table({"p": pa.array([None, None], pa.null())}), directory / "part-0.parquet")
    pq.write_table(pa.table({"p": ["c", "d"]}), directory / "part-1.parquet")
    summary = run_job(job(tiny_model_dir, directory, tmp_path / "out"), progress=False, engine=tiny_engine)
    assert (summary.num_rows, summary.num_errors) == (4, 2)
    rows = rows_of(tmp_path / "out")
    # several files: an error names the file and the row in it
    assert [r["error"] for r in rows[:2]] == [
        f"row {i} (id '{i}', row {i} of part-0.parquet): prompt column 'p' is null" for i in range(2)
    ]
    assert [r["finish_reason"] for r in rows[2:]] == ["length", "length"]
    with pytest.raises(JobError, match="input.prompt_column 'q' is not a column of any file of"):
        run_job(job(tiny_model_dir, directory, tmp_path / "o2", prompt_column="q"), progress=False)


def test_conform_batch_is_the_one_step_every_source_kind_takes():
    class Source:  # any input format: a path, a schema and record batches
        def __init__(self, path, batch):
            self.path, self.schema, self.batch = path, batch.schema, batch

    a = Source("a.jsonl", pa.record_batch({"p": pa.array(["x"]).dictionary_encode(), "n": pa.array([2], pa.int8())}))
    b = Source("b.jsonl", pa.record_batch({"p": pa.array([None], pa.null()), "extra": [1.5]}))
    schema = unify_schemas([a, b])
    assert schema == pa.schema([("p", pa.string()), ("n", pa.int8()), ("extra", pa.float64())])
    assert conform_batch(b.batch, schema, ["p", "n"]).to_pylist() == [{"p": None, "n": None}]
    assert conform_batch(a.batch, schema, ["extra", "p"]).to_pylist() == [{"extra": None, "p": "x"}]
