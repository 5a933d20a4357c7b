"""CLI: exit code 2 with a message for setup problems, a run with manifest + flags + --set, rerun, demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.jobs.cli import main
from cbrun.jobs.output.writer import committed_parts

REPO_ROOT = Path(__file__).resolve().parents[2]
SUMMARY_RE = re.compile(
    r"^cbrun: (\d+) rows \((\d+) errors, (\d+) skipped\) \| \d+ prompt tokens \| \d+ generated "
    r"tokens \| [\d.]+ s \| \d+ tokens/s generated \| peak memory \d+ MiB \| prefix cache "
    r"hit rate [\d.]+% \| \d+ offloads, \d+ soft resets$",
    re.M,
)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(5)], "text": [f"story {i}" for i in range(5)]}), path)
    return path


def output_rows(output_dir) -> list[dict]:
    return sorted(
        (r for p in committed_parts(output_dir) for r in pq.read_table(p).to_pylist()), key=lambda r: r["row_index"]
    )


def test_setup_problems_exit_2_with_a_message(tmp_path, prompts, tiny_model_dir, capsys):
    base = ["run", "--no-progress", "--output", str(tmp_path / "out")]
    cases = [
        (
            ["--model", str(tiny_model_dir), "--input", str(tmp_path / "none.parquet"), "--prompt-column", "text"],
            "input .*none.parquet' not found",
        ),
        (
            ["--model", str(tiny_model_dir), "--input", str(prompts), "--prompt-column", "question"],
            "input.prompt_column 'question' is not a column .*key, text",
        ),
        (["--model", str(tmp_path), "--input", str(prompts), "--prompt-column", "text"], "has no config.json"),
        (["--model", str(tiny_model_dir), "--input", str(prompts)], "exactly one of"),
        ([str(tmp_path / "missing.toml")], "manifest .* not found"),
        (["--input", str(prompts), "--prompt-column", "text"], "model.path is required"),
        (
            [
                "--model",
                str(tiny_model_dir),
                "--input",
                str(prompts),
                "--prompt-column",
                "text",
                "--set",
                "engine.pagesize=4",
            ],
            "unknown setting engine.pagesize",
        ),
    ]
    for args, message in cases:
        assert main(base + args) == 2, args
        err = capsys.readouterr().err
        assert re.search("cbrun: error: .*" + message, err), (args, err)
    assert not (tmp_path / "out").exists()


def test_an_unknown_option_is_reported_by_its_command_with_the_nearest_name(tmp_path, capsys):
    cases = [
        (
            ["run", "--modle", "m", "--output", str(tmp_path / "out")],
            "usage: cbrun run ",
            "cbrun run: error: unrecognized arguments: --modle (did you mean --model?)\n",
        ),
        (  # the hint follows the option's value, never between them
            ["run", "job.toml", "--temprature", "0.5"],
            "usage: cbrun run ",
            "cbrun run: error: unrecognized arguments: --temprature 0.5 (did you mean --temperature?)\n",
        ),
        (
            ["run", "job.toml", "--modle", "m", "--temprature", "0.5"],
            "usage: cbrun run ",
            "unrecognized arguments: --modle m --temprature 0.5 (did you mean --model for --modle, --temperature "
            "for --temprature?)\n",
        ),
        (
            ["run", "--temprature=0.5"],
            "usage: cbrun run ",
            "unrecognized arguments: --temprature=0.5 (did you mean --temperature?)",
        ),
        (
            ["status", str(tmp_path), "--zzz"],
            "usage: cbrun status ",
            "cbrun status: error: unrecognized arguments: --zzz\n",
        ),
    ]
    for args, usage, message in cases:
        with pytest.raises(SystemExit) as exited:
            main(args)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.startswith(usage) and message in err, (args, err)
    assert not (tmp_path / "out").exists()


def test_run_with_manifest_flags_and_set_then_rerun(tmp_path, prompts, tiny_model_dir, capsys):
    manifest = tmp_path / "job.toml"
    manifest.write_text(f"""
[model]
path = "{tiny_model_dir}"
[input]
path = "{prompts}"
prompt_column = "text"
[sampling]
max_new_tokens = 50
[engine]
max_requests_per_batch = 4
[output]
path = "{tmp_path / "out"}"
""")
    args = [
        "run",
        str(manifest),
        "--id-column",
        "key",
        "--max-new-tokens",
        "4",
        "--limit",
        "4",
        "--set",
        "output.commit_every_rows=2",
        "--set",
        "engine.max_batch_tokens=64",
        "--no-progress",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert SUMMARY_RE.search(out).groups() == ("4", "0", "0"), out
    rows = output_rows(tmp_path / "out")
    assert [r["id"] for r in rows] == ["k0", "k1", "k2", "k3"]
    assert all(r["num_completion_tokens"] <= 4 for r in rows)
    assert len(committed_parts(tmp_path / "out")) == 2

    assert main(args) == 0
    assert "already finished: all 4 rows of this input" in capsys.readouterr().out
    assert main(args[:-1] + ["--max-new-tokens", "3", "--no-progress"]) == 2
    assert "sampling.max_new_tokens" in capsys.readouterr().err
    assert main(args[:-1] + ["--max-new-tokens", "3", "--overwrite", "--no-progress"]) == 0
    assert SUMMARY_RE.search(capsys.readouterr().out).groups() == ("4", "0", "0")


def test_demo(tmp_path, capsys):
    assert main(["demo", "--work-dir", str(tmp_path / "demo"), "--num-rows", "16", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "RANDOM weights" in out and "noise" in out and str(tmp_path / "demo" / "output") in out
    assert SUMMARY_RE.search(out).groups() == ("16", "0", "0")
    assert len(output_rows(tmp_path / "demo" / "output")) == 16
    # --output names the output directory itself.
    args = ["demo", "--work-dir", str(tmp_path / "demo"), "--output", str(tmp_path / "out"), "--num-rows", "4"]
    assert main([*args, "--no-progress"]) == 0
    assert f"output in {tmp_path / 'out'} " in capsys.readouterr().out
    assert len(output_rows(tmp_path / "out")) == 4


def test_gsm8k_manifest_on_stories260k(stories260k_dir, tmp_path, monkeypatch, capsys):
    if not (REPO_ROOT / "../shared/data/gsm8k_test.parquet").is_file():
        pytest.skip("gsm8k_test.parquet not present")
    monkeypatch.chdir(REPO_ROOT)  # the manifest's relative paths are written for the repository root
    args = [
        "run",
        "manifests/gsm8k-stories260k.toml",
        "--set",
        f"model.path={stories260k_dir}",
        "--output",
        str(tmp_path / "out"),
        "--limit",
        "6",
        "--max-new-tokens",
        "12",
        "--no-progress",
    ]
    assert main(args) == 0
    assert SUMMARY_RE.search(capsys.readouterr().out).groups() == ("6", "0", "0")
    rows = output_rows(tmp_path / "out")
    source = pq.read_table(REPO_ROOT / "../shared/data/gsm8k_test.parquet", columns=["id"]).column("id")
    assert [r["id"] for r in rows] == source.to_pylist()[:6]
    assert all(r["finish_reason"] in ("stop", "length") and r["completion"] for r in rows)


def test_convert_llama2c_command(shared_dir, tmp_path, capsys):
    src = shared_dir / "models" / "stories260K"
    if not (src / "stories260K.bin").is_file():
        pytest.skip("stories260K files not present")
    assert main(["convert-llama2c", str(src / "stories260K.bin"), str(src / "tok512.bin"), str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "config.json").is_file()
    assert main(["convert-llama2c", str(tmp_path / "none.bin"), str(src / "tok512.bin"), str(tmp_path / "n")]) == 2
    assert "cbrun: error:" in capsys.readouterr().err


def run_python(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter of this checkout; its exit code and output captured."""
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )


def test_exit_process_runs_atexit_handlers_flushes_output_and_exits_with_the_code():
    code = (
        "import atexit, sys\n"
        "from cbrun.jobs.cli.commands import exit_process\n"
        "atexit.register(lambda: print('atexit handler ran'))\n"
        "print('summary line', end='')\n"
        "sys.stderr.write('a warning')\n"
        "exit_process(3)\n"
        "print('not reached')\n"
    )
    done = run_python(code)
    assert done.returncode == 3
    assert done.stdout == "summary lineatexit handler ran\n"
    assert done.stderr == "a warning"


def test_exit_process_returns_while_a_non_daemon_thread_runs():
    # In a subprocess: were it to exit here, it would end the test run with it.
    code = (
        "import threading\n"
        "from cbrun.jobs.cli.commands import exit_process\n"
        "release = threading.Event()\n"
        "threading.Thread(target=release.wait, daemon=False).start()\n"
        "exit_process(3)\n"
        "print('returned')\n"
        "release.set()\n"
    )
    done = run_python(code)
    assert (done.returncode, done.stdout) == (0, "returned\n"), done.stderr


def test_bench_is_the_command_the_benchmarks_register(monkeypatch, capsys):
    import importlib.metadata
    import tomllib

    from cbrun.bench import cli as bench_cli
    from cbrun.jobs.cli.commands import COMMAND_ENTRY_POINTS

    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    target = pyproject["project"]["entry-points"][COMMAND_ENTRY_POINTS]["bench"]
    assert target == f"{bench_cli.__name__}:{bench_cli.main.__name__}"
    calls = []

    class Registered:  # an installed package's entry point
        def load(self):
            return lambda argv: calls.append(argv) or 0

    registered = Registered()
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda group, name: [registered] if (group, name) == (COMMAND_ENTRY_POINTS, "bench") else [],
    )
    assert main(["bench", "--workload", "x"]) == 0 and calls == [["--workload", "x"]]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group, name: [])
    assert main(["bench"]) == 2
    assert "python -m cbrun.bench" in capsys.readouterr().err
