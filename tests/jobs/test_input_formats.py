"""The input formats registry (``cbrun.jobs.input.formats``): the formats found from the package, and the claim that
adding a format is one new file: a CSV format written here into a folder added to the package's ``__path__`` is
read by a ``cbrun run`` job with nothing else changed."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import cbrun.jobs.input.formats as formats
from cbrun.jobs.cli import main
from cbrun.jobs.input.discovery import input_file_format, list_input_files, object_file_format
from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.output.writer import committed_parts
from tests.jobs.cli_args import run_argv

#: A whole input format, as a new module of ``cbrun/jobs/input/formats/`` would hold it.
CSV_FORMAT = '''
"""CSV input (``.csv``), read whole with pyarrow's CSV reader."""

import pyarrow.csv as pa_csv

from cbrun.jobs.input.formats import InputFormat


class CsvSource:
    def __init__(self, path):
        self.path = path
        self.table = pa_csv.read_csv(path)
        self.schema = self.table.schema
        self.num_rows = self.table.num_rows

    def iter_batches(self, columns, batch_size, first_row, skip):
        for start in range(0, self.num_rows, batch_size):
            batch = self.table.select(columns).slice(start, batch_size).combine_chunks().to_batches()[0]
            if skip is None or not skip[start : start + batch.num_rows].all():
                yield first_row + start, batch


FORMAT = InputFormat(name="csv", title="CSV", suffixes=(".csv",), open_file=lambda path, options: CsvSource(path))
'''


@pytest.fixture
def csv_format(tmp_path, monkeypatch):
    """The CSV format's one file, in a folder added to the formats package's ``__path__``."""
    folder = tmp_path / "more_formats"
    folder.mkdir()
    (folder / "csv.py").write_text(textwrap.dedent(CSV_FORMAT))
    monkeypatch.setattr(formats, "__path__", [*formats.__path__, str(folder)])
    yield
    sys.modules.pop(f"{formats.__name__}.csv", None)


def test_the_package_holds_parquet_and_jsonl(tmp_path):
    assert [f.name for f in formats.input_formats()] == ["parquet", "jsonl"]
    assert formats.format_by_suffix("X.JSONL.GZ").name == "jsonl"
    assert formats.format_by_suffix("x.csv") is None
    assert object_file_format("s3://b/in/part.Parquet").name == "parquet"
    hive = tmp_path / "000000_0"
    pq.write_table(pa.table({"prompt": ["a"]}), hive)
    assert input_file_format(hive).name == "parquet"  # by its magic bytes
    (tmp_path / "notes").write_text("not rows")
    assert input_file_format(tmp_path / "notes") is None


def test_two_formats_claiming_one_suffix_are_refused(tmp_path, monkeypatch):
    folder = tmp_path / "clash"
    folder.mkdir()
    clash = "from cbrun.jobs.input.formats import InputFormat\n"
    clash += "FORMAT = InputFormat(name='lines', title='Lines', suffixes=('.jsonl',), open_file=print)\n"
    (folder / "lines.py").write_text(clash)
    monkeypatch.setattr(formats, "__path__", [*formats.__path__, str(folder)])
    try:
        with pytest.raises(ValueError, match=r"input formats 'jsonl' and 'lines' both claim \.jsonl"):
            formats.input_formats()
    finally:
        sys.modules.pop(f"{formats.__name__}.lines", None)


def test_a_new_format_is_one_file(csv_format, tiny_model_dir, tmp_path):
    rows = {"id": ["r0", "r1", "r2"], "prompt": ["one", "two three", "four"]}
    (tmp_path / "in").mkdir()
    lines = [f"{rid},{prompt}\n" for rid, prompt in zip(rows["id"], rows["prompt"], strict=True)]
    (tmp_path / "in" / "prompts.csv").write_text("id,prompt\n" + "".join(lines))
    pq.write_table(pa.table(rows), tmp_path / "prompts.parquet")
    assert "CSV" in formats.titles() and ".csv" in formats.supported_inputs()
    assert list_input_files(tmp_path / "in") == ("files", [tmp_path / "in" / "prompts.csv"])

    options = ("--prompt-column", "prompt", "--id-column", "id", "--max-new-tokens", "3", "--no-progress")
    assert main(run_argv(tiny_model_dir, tmp_path / "in", tmp_path / "out-csv", *options)) == 0
    assert main(run_argv(tiny_model_dir, tmp_path / "prompts.parquet", tmp_path / "out-parquet", *options)) == 0
    from_csv, from_parquet = (
        sorted(
            (r["row_index"], r["id"], r["error"], r["completion_token_ids"])
            for p in committed_parts(tmp_path / out)
            for r in pq.read_table(p).to_pylist()
        )
        for out in ("out-csv", "out-parquet")
    )
    assert [(i, rid, error) for i, rid, error, _ in from_csv] == [(0, "r0", None), (1, "r1", None), (2, "r2", None)]
    assert all(len(ids) == 3 for *_, ids in from_csv)
    assert from_csv == from_parquet  # the same prompts, the same greedy tokens


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # the help's lines joined: a listing may wrap anywhere


def test_the_help_names_the_formats_of_the_registry(capsys):
    run_help = _help(["run", "--help"], capsys)
    assert (
        "Files read: Parquet: .parquet, or a Parquet file of any name (e.g. Hive's 000000_0); JSON Lines: " in run_help
    )
    assert ".csv" not in run_help and "<input formats>" not in run_help
    assert "prompts in (Parquet, JSON Lines, OpenAI batch files)" in _help(["--help"], capsys)


def test_a_new_format_is_in_the_help_with_no_other_change(csv_format, capsys):
    assert "holding JSON Lines; CSV: .csv (names in any letter case)" in _help(["run", "-h"], capsys)
    assert "prompts in (Parquet, JSON Lines, CSV, OpenAI batch files)" in _help(["-h"], capsys)


def test_parsing_a_command_line_imports_no_input_format():
    """The formats' modules (and the pyarrow they import) load when a help is shown, never to parse a command."""
    code = (
        "import sys; from cbrun.jobs.cli.parser import parse_command_line; "
        "parse_command_line(['run', '--model', 'm', '--input', 'i.jsonl', '--output', 'o']); "
        "print(sorted(m for m in sys.modules if m.startswith(('pyarrow', 'cbrun.jobs.input'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_without_the_new_file_csv_is_refused(tmp_path):
    (tmp_path / "x.csv").write_text("prompt\na\n")
    with pytest.raises(InputError, match=r"'.*x\.csv' is not a format cbrun reads; cbrun reads \.parquet"):
        list_input_files(tmp_path / "x.csv")


def test_object_inputs_open_through_the_registry(s3, csv_format, tmp_path, monkeypatch):
    """Parquet objects are read in place, JSON Lines ones (gzip too) and a format without ``open_object`` (the CSV
    one) from a local copy; an object no format claims is refused, naming the suffixes."""
    monkeypatch.setenv("CBRUN_CACHE", str(tmp_path / "cache"))
    buffer = io.BytesIO()
    pq.write_table(pa.table({"prompt": ["a0", "a1"]}), buffer)
    objects = {
        "in/a.parquet": buffer.getvalue(),
        "in/b.jsonl": json.dumps({"prompt": "b0"}).encode() + b"\n",
        "in/c.json.gz": gzip.compress(json.dumps({"prompt": "c0"}).encode() + b"\n"),
        "in/d.csv": b"prompt\nd0\n",
    }
    for key, body in objects.items():
        s3.client().put_object(Bucket=s3.bucket, Key=key, Body=body)
    reader = PromptReader(s3.uri("in"), prompt_column="prompt")
    assert [row.prompt for row in reader.iter_rows()] == ["a0", "a1", "b0", "c0", "d0"]
    s3.client().put_object(Bucket=s3.bucket, Key="in/e.txt", Body=b"not rows")
    with pytest.raises(InputError, match=r"cannot read: 'e\.txt'; in an object store cbrun reads \.parquet, .*\.csv"):
        list_input_files(s3.uri("in"))
