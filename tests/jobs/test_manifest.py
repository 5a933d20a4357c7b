"""Manifest: TOML into dataclasses, unknown keys named, --set and flag overrides, the shipped manifest."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cbrun.jobs.cli.values import parse_set
from cbrun.jobs.config.manifest import load_manifest, manifest_from_dict

REPO_ROOT = Path(__file__).resolve().parents[2]

MANIFEST = """
[model]
path = "models/m"

[input]
path = "data/in.parquet"
prompt_column = "question"
id_column = "id"
limit = 10

[sampling]
max_new_tokens = 64
temperature = 0.0
stop_token_ids = [5, 6]
seed = 7

[engine]
page_size = 8
max_batch_tokens = 128

[output]
path = "out/x"
commit_every_rows = 50
"""


@pytest.fixture
def manifest_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(MANIFEST)
    return path


def test_loads_sections_into_dataclasses(manifest_file):
    m = load_manifest(manifest_file)
    assert m.model.path == "models/m"  # kept as written; resolved against the working directory when used
    assert (m.input.prompt_column, m.input.id_column, m.input.limit) == ("question", "id", 10)
    assert m.sampling.max_new_tokens == 64 and m.sampling.stop_token_ids == (5, 6) and m.sampling.seed is None
    assert m.seed == 7
    # max_requests_per_batch is not in the manifest: the default of the device the job resolves "auto" to
    assert (m.engine.device, m.engine.page_size, m.engine.max_batch_tokens) == ("auto", 8, 128)
    assert m.engine.max_requests_per_batch is None
    assert replace(m.engine, device="cpu").max_requests_per_batch == 256
    assert (m.output.commit_every_rows, m.output.commit_every_seconds, m.output.overwrite) == (50, 30.0, False)


@pytest.mark.parametrize(
    "section, key, message",
    [
        ("modle", "path", r"unknown manifest section \[modle\]"),
        ("input", "prompt_colum", r"unknown setting input.prompt_colum"),
        ("engine", "pagesize", r"unknown setting engine.pagesize.*page_size"),
        ("sampling", "temprature", r"unknown setting sampling.temprature"),
        ("output", "every", r"unknown setting output.every"),
    ],
)
def test_unknown_sections_and_keys_are_named(manifest_file, section, key, message):
    with pytest.raises(ValueError, match=message):
        load_manifest(manifest_file, [f"{section}.{key}=1"])


def test_unknown_key_in_the_file_is_named(manifest_file):
    manifest_file.write_text(MANIFEST.replace("limit = 10", "limit = 10\nlimt = 3"))
    with pytest.raises(ValueError, match="unknown setting input.limt"):
        load_manifest(manifest_file)


def test_invalid_values_raise(manifest_file):
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        load_manifest(manifest_file, ["engine.page_size=0"])
    with pytest.raises(ValueError, match="temperature must be"):
        load_manifest(manifest_file, ["sampling.temperature=-1"])
    with pytest.raises(ValueError, match="exactly one of"):
        load_manifest(manifest_file, ["input.prompt_ids_column=ids"])
    with pytest.raises(ValueError, match="commit_every_rows"):
        load_manifest(manifest_file, ["output.commit_every_rows=0"])
    with pytest.raises(ValueError, match="not valid TOML"):
        manifest_file.write_text("[model\n")
        load_manifest(manifest_file)
    with pytest.raises(FileNotFoundError, match="manifest"):
        load_manifest(manifest_file.with_name("nope.toml"))


@pytest.mark.parametrize(
    "assignments, message",
    [
        # written in the file: the manifest's own [sampling] temperature = -1
        (["sampling.temperature=-1"], "sampling.temperature must be a finite number >= 0, got -1"),
        (["sampling.max_tokens=-1"], "sampling.max_new_tokens must be an integer >= 0, got -1"),  # the vLLM name
        (["sampling.ignore_eos='no'"], "sampling.ignore_eos must be true or false, got 'no'"),
        (["sampling.stop_token_ids=[1.5]"], "sampling.stop_token_ids must be a list of token ids"),
        (["sampling.structured_outputs={regex=''}"], "sampling.structured_outputs.regex must be non-empty text"),
        (["engine.page_size=0"], "engine.page_size must be a positive integer, got 0"),
        (["engine.max_memory_percent='half'"], "engine.max_memory_percent must be a number, got 'half'"),
        (["engine.device=1"], "engine.device must be a string, got 1"),
        (["engine.ngram_min=5"], "engine.ngram_min (5) must be <= engine.ngram_max (4)"),
        (
            ["engine.kv_cache_dtype='fp8_e4m3'", "engine.attention_backend='cpu'"],
            "engine.kv_cache_dtype = fp8_e4m3 runs attention on the PyTorch reference (the cpu kernels read K/V in "
            "the model's dtype); set engine.attention_backend = auto or torch",
        ),
        (["output.commit_every_rows=0"], "output.commit_every_rows must be a positive integer, got 0"),
        (["input.template=3"], "input.template must be a string, got 3"),
        (["input.shard='2/2'"], "input.shard (--shard) must be INDEX/COUNT"),
        (["cluster.num_replicas=0"], "cluster.num_replicas must be a positive integer, got 0"),
    ],
)
def test_a_bad_value_is_named_with_its_section(manifest_file, assignments, message):
    """The engine's settings name themselves bare (its Python API has no sections); a job names them as its
    manifest, ``--set`` and flags spell them."""
    with pytest.raises(ValueError) as refused:
        load_manifest(manifest_file, assignments)
    assert message in str(refused.value)


def test_the_python_api_names_settings_without_a_section():
    from cbrun.engine.config import EngineConfig
    from cbrun.engine.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=r"^page_size must be a positive integer, got 0$"):
        EngineConfig(page_size=0)
    with pytest.raises(ValueError, match=r"^ngram_min \(5\) must be <= ngram_max \(4\)$"):
        EngineConfig(ngram_min=5)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 2$"):
        SamplingParams(top_p=2).validate()


def test_a_setting_error_pickles_with_its_sections():
    import pickle

    from cbrun.engine.setting_error import SettingError

    error = SettingError("{top_p} must be in (0, 1], got {value!r}; see {min_p}", value={"a": 1})
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) == "top_p must be in (0, 1], got {'a': 1}; see min_p"
    assert copy.in_section("sampling") == "sampling.top_p must be in (0, 1], got {'a': 1}; see sampling.min_p"


def _every_setting() -> list[tuple[str, str]]:
    from dataclasses import fields

    from cbrun.engine.config import EngineConfig
    from cbrun.engine.sampling_params import SamplingParams
    from cbrun.jobs.config import settings
    from cbrun.jobs.config.manifest import SECTIONS

    classes = {
        "model": settings.ModelSettings,
        "input": settings.InputSettings,
        "sampling": SamplingParams,
        "engine": EngineConfig,
        "output": settings.OutputSettings,
        "cluster": settings.ClusterSettings,
        "storage": settings.StorageSettings,
    }
    assert set(classes) == set(SECTIONS)
    job_sampling = ["seed", "n", "model_defaults", "prompt_logprobs"]  # the job's own [sampling] keys
    return [(section, f.name) for section, cls in classes.items() for f in fields(cls)] + [
        ("sampling", name) for name in job_sampling
    ]


@pytest.mark.parametrize("bad", ["{x = 1}", "[{x = 1}]"], ids=["table", "list-of-tables"])
def test_every_setting_names_itself_for_a_value_of_the_wrong_type(manifest_file, bad):
    """No setting takes a table (or a list of them); each refuses one by its dotted name, never by a crash or a
    message that leaves the setting out."""
    unnamed = {}
    for section, key in _every_setting():
        try:
            load_manifest(manifest_file, [f"{section}.{key}={bad}"])
        except ValueError as exc:
            if f"{section}.{key}" not in str(exc):
                unnamed[f"{section}.{key}"] = str(exc)
        else:
            unnamed[f"{section}.{key}"] = "accepted"
    assert not unnamed, unnamed


def test_a_bad_flag_value_is_exit_2_naming_the_setting(tmp_path, capsys):
    from cbrun.jobs.cli import main

    argv = ["run", "--model", str(tmp_path / "m"), "--input", str(tmp_path / "in.jsonl")]
    assert main([*argv, "--output", str(tmp_path / "out"), "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "cbrun: error: sampling.temperature must be a finite number >= 0, got -1.0" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--temperature", "abc", "sampling.temperature must be a number, got 'abc'"),
        ("--max-new-tokens", "1.5", "sampling.max_new_tokens must be an integer, got '1.5'"),
        ("--num-threads", "two", "engine.num_threads must be an integer, got 'two'"),
    ],
)
def test_a_flag_value_of_the_wrong_type_is_exit_2_naming_the_setting(tmp_path, capsys, flag, value, said):
    from cbrun.jobs.cli import main

    argv = ["run", "--model", str(tmp_path / "m"), "--input", str(tmp_path / "in.jsonl")]
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--output", str(tmp_path / "out"), flag, value])
    assert exited.value.code == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_parse_set_reads_toml_values_with_string_fallback():
    assert parse_set("sampling.temperature=0.7") == ("sampling", "temperature", 0.7)
    assert parse_set("engine.max_batch_tokens = 1024") == ("engine", "max_batch_tokens", 1024)
    assert parse_set("output.overwrite=true") == ("output", "overwrite", True)
    assert parse_set("sampling.stop_token_ids=[1, 2]") == ("sampling", "stop_token_ids", [1, 2])
    assert parse_set("input.template=Q: {question} A:") == ("input", "template", "Q: {question} A:")
    assert parse_set('input.id_column="42"') == ("input", "id_column", "42")
    with pytest.raises(ValueError, match="SECTION.KEY=VALUE"):
        parse_set("temperature=0.7")


def test_set_and_flags_override_in_order(manifest_file):
    m = load_manifest(
        manifest_file,
        ["sampling.max_new_tokens=5", "engine.device=cpu", "input.limit=3"],
        {"sampling": {"max_new_tokens": 9, "temperature": None}, "input": {"path": "other.parquet"}},
    )
    assert m.sampling.max_new_tokens == 9 and m.sampling.temperature == 0.0  # None flags do not override
    assert m.input.path == "other.parquet" and m.input.limit == 3 and m.engine.device == "cpu"
    with pytest.raises(ValueError, match="unknown setting engine.bogus"):
        load_manifest(manifest_file, ["engine.bogus=1"])


def test_flags_alone_make_a_manifest_and_paths_are_required():
    m = load_manifest(
        None, [], {"model": {"path": "m"}, "input": {"path": "i", "prompt_column": "p"}, "output": {"path": "o"}}
    )
    assert replace(m.engine, device="cpu").page_size == 64 and m.sampling.max_new_tokens == 128
    with pytest.raises(ValueError, match=r"model.path is required.*--model"):
        manifest_from_dict({"input": {"path": "i", "prompt_column": "p"}, "output": {"path": "o"}})


def test_shipped_gsm8k_manifest_is_valid():
    m = load_manifest(REPO_ROOT / "manifests" / "gsm8k-stories260k.toml")
    assert m.model.path == "models/stories260K" and m.input.prompt_column == "question"
    assert m.input.id_column == "id" and m.sampling.temperature == 0.0 and m.engine.page_size == 64
    data = REPO_ROOT / m.input.path  # relative to the repository root, where cbrun is meant to run
    if not data.is_file():
        pytest.skip(f"{data} not present")
    from cbrun.jobs.input.reader import PromptReader

    assert PromptReader(data, prompt_column=m.input.prompt_column, id_column=m.input.id_column).num_rows == 1319
