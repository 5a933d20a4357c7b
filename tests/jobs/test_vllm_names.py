"""Issue 14 §1: vLLM's setting names as aliases (manifest, --set, per-row columns; one fingerprint), whole-word CLI
flags, "did you mean", greedy n > 1 warned once, per-row setting columns named and switchable, and command-line
text read with a manifest string's escapes."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.jobs.cli import main
from cbrun.jobs.cli.parser import build_parser
from cbrun.jobs.cli.values import cli_text
from cbrun.jobs.config.manifest import load_manifest, manifest_from_dict
from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.output.fingerprint import job_fingerprint
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import run_job

PATHS = {"model": {"path": "m"}, "input": {"path": "i", "prompt_column": "p"}, "output": {"path": "o"}}
ENGINE = "engine.page_size=16\nengine.num_blocks=64\nengine.max_batch_tokens=256"


def manifest(sampling: dict):
    return manifest_from_dict({**PATHS, "sampling": sampling})


def test_vllm_names_are_aliases_and_one_job():
    ours = manifest({"max_new_tokens": 7, "min_new_tokens": 2, "top_k": 0})
    theirs = manifest({"max_tokens": 7, "min_tokens": 2, "top_k": -1})  # vLLM's names, and its "off" for top_k
    assert (theirs.sampling.max_new_tokens, theirs.sampling.min_new_tokens, theirs.sampling.top_k) == (7, 2, 0)
    assert theirs.sampling == ours.sampling
    assert job_fingerprint(theirs, 10) == job_fingerprint(ours, 10)
    assert "max_tokens" not in str(job_fingerprint(theirs, 10))  # the canonical name is recorded
    # --set takes either name, and overrides the file's other spelling instead of clashing with it
    m = load_manifest(None, ["sampling.max_tokens=3"], PATHS)
    assert m.sampling.max_new_tokens == 3 and m.sampling_set == {"max_new_tokens"}
    with pytest.raises(ValueError, match="max_new_tokens is given twice"):
        manifest({"max_tokens": 7, "max_new_tokens": 8})
    assert manifest({"prompt_logprobs": 0}).sampling.prompt_logprobs_from == 1  # vLLM's 0: the token's own


def test_per_row_columns_take_vllm_names(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"p": ["a", "b"], "max_tokens": [3, None], "min_tokens": [1.5, None]}), path)
    reader = PromptReader(path, prompt_column="p")
    assert reader.setting_of_column == {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
    first, second = reader.iter_rows()
    assert first.error == "row 0 (id '0'): column 'min_tokens': min_new_tokens must be an integer, got 1.5"
    assert second.sampling_overrides == {}
    pq.write_table(pa.table({"p": ["a"], "max_tokens": [3]}), path)
    assert next(PromptReader(path, prompt_column="p").iter_rows()).sampling_overrides == {"max_new_tokens": 3}
    pq.write_table(pa.table({"p": ["a"], "max_tokens": [3], "max_new_tokens": [4]}), path)
    with pytest.raises(ValueError, match="columns 'max_tokens' and 'max_new_tokens' both set max_new_tokens"):
        PromptReader(path, prompt_column="p")


@pytest.mark.parametrize(
    "key, suggestion",
    [
        ("temprature", "sampling.temperature"),
        ("max_token", "sampling.max_tokens"),
        ("max_new_token", "sampling.max_new_tokens"),
        ("top_pp", "sampling.top_p"),
    ],
)
def test_unknown_setting_suggests_the_closest_name(key, suggestion):
    with pytest.raises(ValueError, match=f"unknown setting sampling.{key} .*did you mean {suggestion}\\?"):
        manifest({key: 1})
    with pytest.raises(ValueError, match="did you mean engine.page_size"):
        manifest_from_dict({**PATHS, "engine": {"pagesize": 8}})


def test_flags_match_whole_words_only():
    args = build_parser().parse_args(
        ["run", "job.toml", "--n", "2", "--max-tokens", "5", "--stop", "a\\n", "--stop", "END", "--num-threads", "1"]
    )
    assert (args.manifest, args.n, args.max_new_tokens, args.stop, args.num_threads, args.no_progress) == (
        "job.toml",
        2,
        5,
        ["a\\n", "END"],
        1,
        False,
    )
    with pytest.raises(SystemExit):  # a prefix of --no-progress is not --no-progress
        build_parser().parse_args(["run", "--no-prog"])
    assert build_parser().parse_args(["run", "--max-new-tokens", "4"]).max_new_tokens == 4


def test_command_line_text_reads_a_manifest_strings_escapes():
    assert cli_text(r"Q: {question}\nA:") == "Q: {question}\nA:"
    assert cli_text(r"tab\there \\n \"q\" \u00e9") == 'tab\there \\n "q" é'
    with pytest.raises(ValueError, match=r"unknown escape \\d"):
        cli_text(r"\d+")


def test_template_flag_and_manifest_give_the_same_prompt(tiny_model_dir, tmp_path, capsys):
    pq.write_table(pa.table({"question": ["2+2?", "3+3?"]}), tmp_path / "in.parquet")
    (tmp_path / "job.toml").write_text(
        f'[model]\npath = "{tiny_model_dir}"\n[input]\npath = "{tmp_path}/in.parquet"\n'
        f'template = "Q: {{question}}\\nA:"\n[sampling]\nmax_new_tokens = 2\n'
        f'[output]\npath = "{tmp_path}/a"\n'
    )
    assert load_manifest(tmp_path / "job.toml").input.template == "Q: {question}\nA:"
    engine_sets = [a for line in ENGINE.splitlines() for a in ("--set", line)]
    assert main(["run", str(tmp_path / "job.toml"), "--no-progress", *engine_sets]) == 0
    assert (
        main(
            [
                "run",
                "--model",
                str(tiny_model_dir),
                "--input",
                str(tmp_path / "in.parquet"),
                "--template",
                r"Q: {question}\nA:",
                "--max-tokens",
                "2",
                "--output",
                str(tmp_path / "b"),
                "--no-progress",
                *engine_sets,
            ]
        )
        == 0
    )
    a, b = (read_output(tmp_path / d).sort_by("row_index").to_pylist() for d in ("a", "b"))
    assert [r["num_prompt_tokens"] for r in a] == [r["num_prompt_tokens"] for r in b] == [len("Q: 2+2?\nA:") + 1] * 2
    assert [r["completion_token_ids"] for r in a] == [r["completion_token_ids"] for r in b]
    # both spellings are one job: the flag run's output directory accepts the manifest (resume finds it done)
    assert (
        main(["run", str(tmp_path / "job.toml"), "--output", str(tmp_path / "b"), "--no-progress", *engine_sets]) == 0
    )
    assert "job already finished" in capsys.readouterr().out


def test_per_row_setting_columns_are_named_and_can_be_turned_off(tiny_model_dir, tmp_path, caplog):
    # a metadata column that happens to be called "seed" (strings): read as a setting it fails every row
    pq.write_table(pa.table({"p": ["a", "b"], "seed": ["batch-1", "batch-2"], "n": [1, 2]}), tmp_path / "in.parquet")
    with caplog.at_level(logging.INFO, logger="cbrun"):
        reader = PromptReader(tmp_path / "in.parquet", prompt_column="p")
    assert "per-row settings from columns: seed, n" in caplog.text
    assert "column 'seed' sets seed per row but holds string" in caplog.text  # said at start, not row by row
    assert "column 'n' sets" not in caplog.text
    assert all("seed must be an integer, got 'batch-1'" in r.error for r in list(reader.iter_rows())[:1])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cbrun"):
        reader = PromptReader(tmp_path / "in.parquet", prompt_column="p", per_row_settings=False)
    assert "per-row settings" not in caplog.text
    assert reader.sampling_columns == [] and reader.samples_column is None
    assert [(r.error, r.sampling_overrides, r.num_samples) for r in reader.iter_rows()] == [(None, {}, None)] * 2
    m = load_manifest(
        None,
        ["input.per_row_settings=false", "sampling.max_new_tokens=2", *ENGINE.splitlines()],
        {
            "model": {"path": str(tiny_model_dir)},
            "input": {"path": str(tmp_path / "in.parquet"), "prompt_column": "p"},
            "output": {"path": str(tmp_path / "out")},
        },
    )
    summary = run_job(m, progress=False)
    assert (summary.num_rows, summary.num_output_rows, summary.num_errors) == (2, 2, 0)


def test_greedy_samples_warn_once(tiny_model_dir, tmp_path, caplog):
    pq.write_table(pa.table({"p": ["a", "b", "c"]}), tmp_path / "in.parquet")
    m = load_manifest(
        None,
        ["sampling.n=2", "sampling.max_new_tokens=2", *ENGINE.splitlines()],
        {
            "model": {"path": str(tiny_model_dir)},
            "input": {"path": str(tmp_path / "in.parquet"), "prompt_column": "p"},
            "output": {"path": str(tmp_path / "out")},
        },
    )
    with caplog.at_level(logging.WARNING, logger="cbrun"):
        summary = run_job(m, progress=False)
    assert summary.num_output_rows == 6
    warnings = [r.getMessage() for r in caplog.records if "samples are identical" in r.getMessage()]
    assert len(warnings) == 1 and "asks for 2 samples with greedy decoding" in warnings[0]
    rows = read_output(tmp_path / "out").to_pylist()
    by_row = {}
    for row in rows:
        by_row.setdefault(row["row_index"], []).append(row["completion_token_ids"])
    assert all(a == b for a, b in by_row.values())  # what the warning says: identical samples


def test_settings_given_in_code_count_as_set_and_sections_get_suggestions():
    from cbrun.engine.sampling_params import SamplingParams
    from cbrun.jobs.config.manifest import JobManifest
    from cbrun.jobs.config.settings import InputSettings

    m = JobManifest(input=InputSettings(path="i", prompt_column="p"), sampling=SamplingParams(temperature=0.5))
    assert m.sampling_set == {"temperature"}  # so the model's generation_config.json does not replace it
    with pytest.raises(ValueError, match=r"unknown manifest section \[smapling\]; did you mean \[sampling\]\?"):
        manifest_from_dict({**PATHS, "smapling": {}})


def test_reading_setting_columns_or_not_is_part_of_the_job():
    with_columns = manifest_from_dict(PATHS)
    as_data = manifest_from_dict({**PATHS, "input": {**PATHS["input"], "per_row_settings": False}})
    assert job_fingerprint(with_columns, 3)["input"]["per_row_settings"] is True
    assert job_fingerprint(as_data, 3) != job_fingerprint(with_columns, 3)
