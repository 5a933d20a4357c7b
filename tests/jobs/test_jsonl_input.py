"""JSON Lines input (a broken line and mixed types are row errors; .jsonl.gz; a directory mixing Parquet and
JSONL; resume), input columns kept in the output with their Arrow types, and repeated ids counted and named."""

from __future__ import annotations

import gzip
import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.output.writer import committed_parts
from cbrun.jobs.run.job import JobError, run_job

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=256, max_requests_per_batch=8, num_blocks=64)
LINES = [
    {"id": "a", "prompt": "hello", "temperature": 0, "meta": {"k": [1, 2]}},
    "",
    {"id": "b", "prompt": 5, "temperature": 0.5},
    '{"id": "c", "prompt": "broken',
    [1, 2],
    {"id": "d", "prompt": "world", "meta": {"k": [3], "j": "x"}},
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from cbrun.engine import LLMEngine

    return LLMEngine.from_pretrained(str(tiny_model_dir), ENGINE_CONFIG)


def write_jsonl(path, lines, compress=False) -> str:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    if compress:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def manifest(model_dir, input_path, output_dir, keep=(), **input_settings) -> JobManifest:
    input_settings.setdefault("prompt_column", "prompt")
    return JobManifest(
        model=ModelSettings(path=str(model_dir)),
        input=InputSettings(path=str(input_path), **input_settings),
        sampling=SamplingParams(max_new_tokens=3),
        engine=ENGINE_CONFIG,
        output=OutputSettings(path=str(output_dir), keep_columns=list(keep)),
    )


def output_rows(output_dir) -> dict[int, dict]:
    rows = [r for p in committed_parts(output_dir) for r in pq.read_table(p).to_pylist()]
    by_index = {r["row_index"]: r for r in rows}
    assert len(by_index) == len(rows)
    return by_index


@pytest.mark.parametrize("compress", [False, True])
def test_broken_line_and_mixed_types_are_row_errors(tmp_path, compress):
    path = write_jsonl(tmp_path / ("in.jsonl.gz" if compress else "in.jsonl"), LINES, compress)
    reader = PromptReader(path, prompt_column="prompt", id_column="id", batch_size=2)
    schema = reader.sources[0].schema
    assert schema.names == ["id", "prompt", "temperature", "meta"]
    assert schema.field("temperature").type == pa.float64()  # integers and numbers: float64
    assert schema.field("meta").type == pa.struct([("k", pa.list_(pa.int64())), ("j", pa.string())])
    assert reader.num_rows == 5  # the blank line is not a row
    rows = list(reader.iter_rows())
    name = "in.jsonl.gz" if compress else "in.jsonl"
    assert [(r.row_index, r.id, r.prompt) for r in rows] == [
        (0, "a", "hello"),
        (1, "b", None),
        (2, "2", None),
        (3, "3", None),
        (4, "d", "world"),
    ]
    assert rows[0].sampling_overrides == {"temperature": 0.0} and rows[0].error is None
    assert rows[1].error == (
        f"row 1 (id 'b', line 3 of {name}): field 'prompt' holds an integer (5), but the column's type (from the "
        f"other lines) is string"
    )
    assert rows[2].error.startswith(f"row 2 (id '2', line 4 of {name}): the line is not valid JSON: Unterminated")
    assert rows[3].error == f"row 3 (id '3', line 5 of {name}): the line is not a JSON object (it is an array)"
    # A field the job does not read never makes a row an error; done rows are not read.
    assert [r.error for r in PromptReader(path, prompt_column="id").iter_rows()][:2] == [None, None]
    done = np.array([True, True, False, True, False])
    assert [r.row_index for r in reader.iter_rows(done)] == [2, 4]


#: Rows that read but cannot run, between blank lines (which are not rows but count as lines).
BAD_ROWS = [
    {"id": "ok", "prompt": "hello"},
    "",
    {"id": "null", "prompt": None},
    {"id": "missing"},
    "   ",
    {"id": "empty", "prompt": ""},
    {"prompt": "no id"},
    {"id": "hot", "prompt": "x", "temperature": -1},
    {"id": "long", "prompt": "word " * 400},
]


@pytest.mark.parametrize("arrow", [True, False], ids=["pyarrow-reader", "line-by-line"])
def test_every_row_error_names_its_line_and_id(tiny_model_dir, engine, tmp_path, monkeypatch, arrow):
    """Whether the reader (a null, missing or empty prompt, a null id) or the job (a bad per-row setting, an
    over-long prompt) finds the fault, the error row names the line as an editor numbers it, blank lines
    counted, and the row's id."""
    from cbrun.jobs.input.formats.jsonl import JsonlSource

    if not arrow:
        monkeypatch.setattr(JsonlSource, "_arrow_scan", lambda self: False)
    path = write_jsonl(tmp_path / "in.jsonl", BAD_ROWS)
    assert PromptReader(path, prompt_column="prompt").sources[0].arrow_readable is arrow
    summary = run_job(manifest(tiny_model_dir, path, tmp_path / "out", id_column="id"), progress=False, engine=engine)
    assert (summary.num_rows, summary.num_errors) == (7, 6)
    errors = [row["error"] for _, row in sorted(output_rows(tmp_path / "out").items())]
    assert errors[0] is None
    assert errors[1] == "row 1 (id 'null', line 3 of in.jsonl): prompt column 'prompt' is null"
    assert errors[2] == "row 2 (id 'missing', line 4 of in.jsonl): prompt column 'prompt' is null"
    assert errors[3] == "row 3 (id 'empty', line 6 of in.jsonl): prompt column 'prompt' is empty"
    assert errors[4] == "row 4 (id '4', line 7 of in.jsonl): id column 'id' is null"
    assert errors[5] == "row 5 (id 'hot', line 8 of in.jsonl): temperature must be a finite number >= 0, got -1.0"
    assert errors[6].startswith("row 6 (id 'long', line 9 of in.jsonl): the prompt has 2001 tokens, but the model")


def test_a_file_without_errors_is_not_read_for_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, "", {"prompt": "b"}])
    reader = PromptReader(path, prompt_column="prompt")
    assert [(r.prompt, r.error) for r in reader.iter_rows()] == [("a", None), ("b", None)]
    source = reader.sources[0]
    assert source._blank_lines is None  # the scan for blank lines waits for a row's error
    assert [source.row_place(0), source.row_place(1)] == ["line 1 of in.jsonl", "line 3 of in.jsonl"]


def test_a_line_that_is_not_utf8_is_its_rows_error_named_by_line_number(tmp_path):
    """pyarrow's JSON reader keeps bytes that are not UTF-8; the row's error must still name the line."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "bad \xff\xfe here"}\n{"prompt": "fine"}\n')
    rows = list(PromptReader(path, prompt_column="prompt").iter_rows())
    assert [(r.prompt, r.error) for r in rows] == [
        ("ok", None),
        (None, "row 1 (id '1', line 3 of in.jsonl): the line is not UTF-8 text (byte 0xff at offset 16)"),
        ("fine", None),
    ]


def test_jsonl_job_and_a_directory_mixing_parquet_and_jsonl(tiny_model_dir, engine, tmp_path):
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ["p0", "p1"], "prompt": ["one", "two"]}), tmp_path / "in" / "a.parquet")
    write_jsonl(tmp_path / "in" / "b.jsonl", LINES)
    summary = run_job(
        manifest(tiny_model_dir, tmp_path / "in", tmp_path / "out", id_column="id"), progress=False, engine=engine
    )
    assert (summary.num_rows, summary.num_errors) == (7, 3)
    rows = output_rows(tmp_path / "out")
    assert [rows[i]["id"] for i in range(7)] == ["p0", "p1", "a", "b", "4", "5", "d"]
    assert [rows[i]["finish_reason"] == "error" for i in range(7)] == [False, False, False, True, True, True, False]
    assert rows[4]["error"].startswith("row 4 (id '4', line 4 of b.jsonl): the line is not valid JSON")
    assert rows[3]["error"].startswith("row 3 (id 'b', line 3 of b.jsonl): field 'prompt' holds an integer")


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_empty_jsonl_is_an_empty_input(tiny_model_dir, engine, tmp_path, text):
    # A 0-byte (or blank) file names no column: it is an input with no rows, not a missing column.
    (tmp_path / "in.jsonl").write_text(text)
    job = manifest(tiny_model_dir, tmp_path / "in.jsonl", tmp_path / "out", id_column="id", keep=["answer"])
    summary = run_job(job, progress=False, engine=engine)
    assert (summary.num_rows, summary.num_errors) == (0, 0)
    assert (tmp_path / "out" / "_SUCCESS").is_file()
    # A file with rows but without the column is still refused, naming its columns.
    write_jsonl(tmp_path / "rows.jsonl", [{"question": "q"}])
    with pytest.raises(JobError, match="'prompt' is not a column of .*its columns are: question"):
        run_job(manifest(tiny_model_dir, tmp_path / "rows.jsonl", tmp_path / "out2"), progress=False, engine=engine)


def test_parquet_input_keeps_an_answer_column(tiny_model_dir, engine, tmp_path):
    struct = pa.struct([("source", pa.string()), ("page", pa.int16())])
    pq.write_table(
        pa.table(
            {
                "prompt": ["2+2=", None, "3+3="],
                "answer": pa.array([4, 5, None], pa.int8()),
                "meta": pa.array([{"source": "s1", "page": 1}, None, {"source": "s3", "page": 3}], struct),
            }
        ),
        tmp_path / "in.parquet",
    )
    run_job(
        manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", keep=["answer", "meta"]),
        progress=False,
        engine=engine,
    )
    table = pq.read_table(committed_parts(tmp_path / "out")[0])
    assert table.schema.field("answer").type == pa.int8() and table.schema.field("meta").type == struct
    rows = sorted(table.to_pylist(), key=lambda r: r["row_index"])
    assert [(r["answer"], r["meta"]) for r in rows] == [
        (4, {"source": "s1", "page": 1}),
        (5, None),
        (None, {"source": "s3", "page": 3}),
    ]
    assert rows[1]["finish_reason"] == "error"  # an error row keeps its columns too
    recorded = json.loads((tmp_path / "out" / "_cbrun" / "job.json").read_text())
    assert recorded["output"] == {"keep_columns": ["answer", "meta"]}


def test_kept_column_that_clashes_or_is_missing_is_refused_before_any_work(tiny_model_dir, tmp_path):
    pq.write_table(pa.table({"prompt": ["x"], "completion": ["y"]}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match="output.keep_columns 'completion' clashes with the output column"):
        run_job(
            manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", keep=["completion"]), progress=False
        )
    with pytest.raises(
        JobError, match="output.keep_columns 'answer' is not an input column; input columns: prompt, completion"
    ):
        run_job(manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", keep=["answer"]), progress=False)
    assert not (tmp_path / "out").exists()


def test_repeated_ids_are_counted_and_named(tiny_model_dir, engine, tmp_path, caplog):
    ids = ["a", "b", "a", "c", "b", "a", None]
    pq.write_table(
        pa.table({"id": ids, "prompt": [f"p{i}" for i in range(7)]}), tmp_path / "in.parquet", row_group_size=3
    )
    with caplog.at_level(logging.WARNING, logger="cbrun"):
        summary = run_job(
            manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", id_column="id"),
            progress=False,
            engine=engine,
        )
    assert summary.num_repeated_ids == 2 and "| 2 repeated ids" in summary.line()
    assert "input.id_column 'id' repeats values: 'a' (3 rows), 'b' (2 rows); rows are keyed by row_index" in caplog.text
    assert len(output_rows(tmp_path / "out")) == 7  # every row written once, keyed by row_index
    limited = manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out2", id_column="id", limit=2)
    assert run_job(limited, progress=False, engine=engine).num_repeated_ids == 0


def test_clean_file_reads_with_pyarrow_and_the_same_rows_as_line_by_line(tmp_path, monkeypatch):
    from cbrun.jobs.input.formats.jsonl import JsonlSource

    lines = [
        {"id": f"r{i}", "prompt": f"p {i}", "day": "2024-01-0" + str(i % 9 + 1), "temperature": 0.5, "meta": {"k": [i]}}
        for i in range(7)
    ]
    lines.insert(3, "   ")
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    columns = dict(prompt_column="prompt", id_column="id", extra_columns={"day": "day", "meta": "meta"}, batch_size=3)
    fast = PromptReader(path, **columns)
    assert fast.sources[0].arrow_readable and fast.num_rows == 7
    assert fast.sources[0].schema.field("day").type == pa.string()  # dates stay text
    monkeypatch.setattr(JsonlSource, "_arrow_scan", lambda self: False)
    slow = PromptReader(path, **columns)
    assert not slow.sources[0].arrow_readable and slow.sources[0].schema == fast.sources[0].schema
    done = np.array([False, True, True, True, False, True, False])
    for mask in (None, done):
        rows = list(fast.iter_rows(mask))
        assert rows == list(slow.iter_rows(mask))
    assert [(r.row_index, r.id, r.extra["meta"]) for r in rows] == [
        (0, "r0", {"k": [0]}),
        (4, "r4", {"k": [4]}),
        (6, "r6", {"k": [6]}),
    ]
