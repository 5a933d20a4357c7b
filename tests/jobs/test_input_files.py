"""Which input files are read, never silently skipped: suffixes in any letter case, ``.json`` holding JSON Lines,
suffix-less Parquet, hidden files ignored, unreadable files refused at setup; an output that overlaps the input
refused, and a refused run leaves no output directory it made; an empty input said plainly; ``cbrun status``
reporting error rows with ``cbrun run``'s exit code."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.jobs.cli import main
from cbrun.jobs.input.discovery import list_input_files
from cbrun.jobs.input.errors import InputError
from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.output.writer import committed_parts
from tests.jobs.cli_args import run_argv


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def prompts_of(reader: PromptReader) -> list[str]:
    return [row.prompt for row in reader.iter_rows()]


@pytest.fixture
def mixed_dir(tmp_path):
    """A directory of every readable kind, plus files Spark/Hive write beside data, which are not data."""
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["a0", "a1"]}), root / "A.PARQUET")
    write_jsonl(root / "b.json", [{"prompt": "b0"}])  # JSON Lines named .json (datasets' to_json)
    write_jsonl(root / "c.JSONL", [{"prompt": "c0"}])
    pq.write_table(pa.table({"prompt": ["d0"]}), root / "sub" / "000000_0")  # Hive: Parquet without a suffix
    (root / "_SUCCESS").write_text("")
    (root / ".A.PARQUET.crc").write_bytes(b"\x00\x01")
    (root / "_temporary").mkdir()
    (root / "_temporary" / "junk.csv").write_text("x\n")
    (root / "README.md").write_text("# a data set\n")
    return root


def test_directory_reads_every_data_file_in_any_case_and_ignores_hidden_ones(mixed_dir):
    kind, files = list_input_files(mixed_dir)
    assert kind == "files"
    assert [f.relative_to(mixed_dir).as_posix() for f in files] == ["A.PARQUET", "b.json", "c.JSONL", "sub/000000_0"]
    assert prompts_of(PromptReader(mixed_dir, prompt_column="prompt")) == ["a0", "a1", "b0", "c0", "d0"]


def test_directory_with_unreadable_files_is_refused_naming_them(mixed_dir, tmp_path, tiny_model_dir, capsys):
    (mixed_dir / "c.csv").write_text("prompt\nx\n")
    (mixed_dir / "notes.txt").write_text("not rows\n")
    with pytest.raises(InputError, match=r"cannot read: 'c\.csv', 'notes\.txt'; cbrun reads \.parquet, \.jsonl"):
        list_input_files(mixed_dir)
    out = tmp_path / "out"
    assert (
        main(
            [
                *run_argv(str(tiny_model_dir), str(mixed_dir), str(out), "--no-progress", "--prompt-column", "prompt"),
            ]
        )
        == 2
    )
    assert "c.csv" in capsys.readouterr().err
    assert not out.exists()


def test_json_file_given_directly(tmp_path):
    lines = tmp_path / "x.json"
    write_jsonl(lines, [{"prompt": "p0"}, {"prompt": "p1"}])
    assert prompts_of(PromptReader(lines, prompt_column="prompt")) == ["p0", "p1"]
    array = tmp_path / "y.json"
    array.write_text(json.dumps([{"prompt": "p0"}]))
    with pytest.raises(InputError, match=r"'.*y\.json' is JSON but not JSON Lines .*cbrun reads \.parquet, \.jsonl"):
        PromptReader(array, prompt_column="prompt")
    pretty = tmp_path / "dataset_info.json"
    pretty.write_text(json.dumps({"features": {"prompt": "string"}}, indent=2))
    with pytest.raises(InputError, match=r"dataset_info\.json' is JSON but not JSON Lines"):
        PromptReader(pretty, prompt_column="prompt")
    csv = tmp_path / "z.csv"
    csv.write_text("prompt\np0\n")
    with pytest.raises(InputError, match=r"'.*z\.csv' is not a format cbrun reads; cbrun reads \.parquet"):
        PromptReader(csv, prompt_column="prompt")


@pytest.mark.parametrize("where", ["same", "inside", "holds"])
def test_output_overlapping_the_input_is_refused(tmp_path, tiny_model_dir, capsys, where):
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"prompt": ["a"]}), data / "in.parquet")
    inp, out = {"same": (data, data), "inside": (data, data / "out"), "holds": (data / "in.parquet", tmp_path)}[where]
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert (
        main(
            [
                *run_argv(str(tiny_model_dir), str(inp), str(out), "--no-progress", "--prompt-column", "prompt"),
            ]
        )
        == 2
    )
    assert re.search(r"cbrun: error: output directory .* would be read back as input", capsys.readouterr().err)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before  # nothing created


def test_a_run_refused_after_taking_the_lock_leaves_no_output_directory(tmp_path, tiny_model_dir, capsys, monkeypatch):
    import cbrun.jobs.run.locked_run
    from cbrun.jobs.run.resources import JobError

    def unloadable(*args, **kwargs):
        raise JobError("cannot load the model: broken weights")

    monkeypatch.setattr(cbrun.jobs.run.locked_run, "load_engine", unloadable)
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a"]}), path)
    args = ["run", "--no-progress", "--model", str(tiny_model_dir), "--input", str(path), "--prompt-column", "prompt"]
    assert main(args + ["--output", str(tmp_path / "new")]) == 2
    assert "broken weights" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()  # a directory the user made: kept
    assert main(args + ["--output", str(tmp_path / "old")]) == 2
    assert (tmp_path / "old").is_dir()


@pytest.mark.parametrize("limit", [None, 0])
def test_empty_input_is_said_plainly(tmp_path, tiny_model_dir, capsys, limit):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": pa.array([] if limit is None else ["a"], pa.string())}), path)
    args = [
        *run_argv(str(tiny_model_dir), str(path), str(tmp_path / "out"), "--no-progress", "--prompt-column", "prompt"),
    ] + ([] if limit is None else ["--limit", str(limit)])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "cbrun: warning: the input has no rows to run" in out
    assert "already finished" not in out


def test_status_reports_error_rows_with_the_run_exit_code(tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "b", None]}), path)  # null prompts: error rows
    base = [
        "run",
        "--no-progress",
        "--model",
        str(tiny_model_dir),
        "--input",
        str(path),
        "--prompt-column",
        "prompt",
        "--max-new-tokens",
        "2",
    ]
    assert main(base + ["--output", str(tmp_path / "bad")]) == 3
    capsys.readouterr()
    assert main(["status", str(tmp_path / "bad")]) == 3
    report = capsys.readouterr().out
    assert "too many errors (exit code 3): 2 of 4 output rows are error rows" in report
    assert "--retry-errors" in report and "output.max_error_fraction = 0.1" in report

    assert main(base + ["--output", str(tmp_path / "ok"), "--set", "output.max_error_fraction=0.5"]) == 0
    capsys.readouterr()
    assert main(["status", str(tmp_path / "ok")]) == 0
    report = capsys.readouterr().out
    assert "job complete (_SUCCESS written): 2 of 4 output rows are error rows" in report
    assert len(committed_parts(tmp_path / "ok")) >= 1
