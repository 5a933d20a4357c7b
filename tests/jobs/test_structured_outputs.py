"""Structured outputs through jobs: the [sampling] constraint, the per-row column, OpenAI batch ``response_format``,
the ``structured_output_valid`` column, row errors for bad constraints, and the fingerprint."""

from __future__ import annotations

import json

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.engine.structured_output import StructuredOutputsParams
from cbrun.jobs.config.manifest import JobManifest, load_manifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from cbrun.jobs.output.fingerprint import job_fingerprint
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import run_job
from tests.jobs.test_openai_batch import CHAT, COMPLETIONS, read_results, request, write_jsonl

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=512, max_requests_per_batch=16, num_blocks=128)
#: Nested object, enum, bounded integer, bounded array and strings: its longest form fits the 256-token model.
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "meta": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["label", "score", "words", "meta"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    from cbrun.engine import LLMEngine

    return LLMEngine.from_pretrained(str(chat_model_dir), ENGINE_CONFIG)


def manifest(model_dir, input_path, output_dir, sampling: SamplingParams, **output) -> JobManifest:
    return JobManifest(
        model=ModelSettings(path=str(model_dir)),
        input=InputSettings(path=str(input_path), prompt_column="prompt"),
        sampling=sampling,
        engine=ENGINE_CONFIG,
        output=OutputSettings(path=str(output_dir), **output),
    )


def test_job_constraint_and_per_row_column(chat_model_dir, engine, tmp_path):
    """The job's schema for most rows; a struct column gives others a regex, a choice, a grammar or a bad schema."""
    per_row = [
        None,
        None,
        {"regex": r"[0-9]{3}"},
        {"choice": ["a", "bb"]},
        {"grammar": 'root ::= "<" [a-z]{1,4} ">"'},
        {"json": json.dumps({"type": "nonsense"})},
        None,
        None,
    ]
    column = pa.array(
        per_row,
        pa.struct(
            [("json", pa.string()), ("regex", pa.string()), ("choice", pa.list_(pa.string())), ("grammar", pa.string())]
        ),
    )
    pq.write_table(
        pa.table({"prompt": [f"Row {i}:" for i in range(8)], "structured_outputs": column}), tmp_path / "in.parquet"
    )
    sampling = SamplingParams(
        max_new_tokens=200, temperature=1.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    summary = run_job(
        manifest(chat_model_dir, tmp_path / "in.parquet", tmp_path / "out", sampling), progress=False, engine=engine
    )
    rows = sorted(read_output(tmp_path / "out").to_pylist(), key=lambda r: r["row_index"])
    assert summary.num_errors == 1 and "$.type: type is malformed" in rows[5]["error"]
    assert rows[5]["structured_output_valid"] is None
    for row in rows[:5] + rows[6:]:
        assert row["finish_reason"] == "stop" and row["structured_output_valid"] is True, row
    for row in rows[:2] + rows[6:]:
        jsonschema.validate(json.loads(row["completion"]), SCHEMA)
    assert rows[3]["completion"] in ("a", "bb") and len(rows[2]["completion"]) == 3


def test_length_cut_rows_are_marked_invalid_and_free_rows_null(chat_model_dir, engine, tmp_path):
    pq.write_table(
        pa.table(
            {"prompt": ["a", "b"], "max_tokens": [5, 20], "structured_outputs": [json.dumps({"json": SCHEMA}), None]}
        ),
        tmp_path / "in.parquet",
    )
    run_job(
        manifest(chat_model_dir, tmp_path / "in.parquet", tmp_path / "out", SamplingParams()),
        progress=False,
        engine=engine,
    )
    rows = sorted(read_output(tmp_path / "out").to_pylist(), key=lambda r: r["row_index"])
    assert rows[0]["finish_reason"] == "length" and rows[0]["structured_output_valid"] is False
    assert rows[1]["structured_output_valid"] is None


def test_openai_batch_response_format_bodies_validate(chat_model_dir, engine, tmp_path):
    json_schema = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA, "strict": True}}
    lines = [
        request(
            f"chat-{i}",
            CHAT,
            {
                "messages": [{"role": "user", "content": f"Review {i}"}],
                "max_tokens": 200,
                "temperature": 1.0,
                "seed": i,
                "n": 2,
                "response_format": json_schema,
            },
        )
        for i in range(3)
    ]
    lines.append(request("cmpl", COMPLETIONS, {"prompt": "Label:", "max_tokens": 200, "response_format": json_schema}))
    lines.append(
        request(
            "object",
            CHAT,
            {
                "messages": [{"role": "user", "content": "Any"}],
                "max_tokens": 200,
                "response_format": {"type": "json_object"},
            },
        )
    )
    lines.append(
        request(
            "text",
            CHAT,
            {"messages": [{"role": "user", "content": "Free"}], "max_tokens": 3, "response_format": {"type": "text"}},
        )
    )
    path = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out"
    run_job(
        JobManifest(
            model=ModelSettings(path=str(chat_model_dir)),
            input=InputSettings(path=str(path)),
            sampling=SamplingParams(max_new_tokens=4),
            engine=ENGINE_CONFIG,
            output=OutputSettings(path=str(out), format="openai-batch"),
        ),
        progress=False,
        engine=engine,
    )
    results = {line["custom_id"]: line for line in read_results(out)}
    assert all(line["error"] is None for line in results.values())
    for custom_id in ["chat-0", "chat-1", "chat-2", "object"]:
        body = ChatCompletion.model_validate(results[custom_id]["response"]["body"])
        for choice in body.choices:
            if custom_id == "object":  # an object of any size: the noise model may not close it in time
                assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)
            else:
                assert choice.finish_reason == "stop"
                jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    completion = Completion.model_validate(results["cmpl"]["response"]["body"])
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)
    valid = read_output(out, columns=["structured_output_valid"]).column(0).to_pylist()
    assert valid.count(None) == 1 and valid.count(True) >= 7  # the object row may be cut by max_tokens


def test_manifest_section_and_fingerprint(chat_model_dir, tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(
        f'[model]\npath = "{chat_model_dir}"\n[input]\npath = "in.parquet"\nprompt_column = "p"\n'
        f'[output]\npath = "out"\n[sampling]\nmax_tokens = 8\n'
        f"[sampling.structured_outputs]\njson = '{json.dumps(SCHEMA)}'\n"
    )
    loaded = load_manifest(toml)
    assert loaded.sampling.structured_outputs == StructuredOutputsParams(json=json.dumps(SCHEMA))
    as_dict = loaded.sampling.replace(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    regex = loaded.sampling.replace(structured_outputs={"regex": "a+"})
    free = loaded.sampling.replace(structured_outputs=None)

    def fingerprint(sampling):
        return job_fingerprint(
            JobManifest(model=loaded.model, input=loaded.input, sampling=sampling, output=loaded.output), 1
        )["sampling"]

    with pytest.MonkeyPatch.context() as patch:  # content hashes of files this test does not write
        patch.setattr("cbrun.jobs.output.fingerprint.input_fingerprint", lambda path, endpoint_url=None: [])
        assert fingerprint(loaded.sampling) == fingerprint(as_dict)  # one schema, as text or as a table
        assert fingerprint(loaded.sampling)["structured_outputs"] == {"json": SCHEMA}
        assert fingerprint(regex) != fingerprint(loaded.sampling)
        assert "structured_outputs" not in fingerprint(free)  # earlier jobs keep their fingerprint


def test_unenforced_keyword_in_the_job_exits_2_before_any_row(chat_model_dir, tmp_path, capsys):
    """A job-level schema with a keyword no engine enforces is refused at load, naming keyword and path."""
    from cbrun.jobs.cli import main

    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "in.parquet")
    toml = tmp_path / "job.toml"
    schema = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}}}
    toml.write_text(
        f'[model]\npath = "{chat_model_dir}"\n[input]\npath = "in.parquet"\nprompt_column = "prompt"\n'
        f'[output]\npath = "out"\n[sampling]\nmax_tokens = 8\n'
        f"[sampling.structured_outputs]\njson = '{json.dumps(schema)}'\n"
    )
    assert main(["run", str(toml), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cbrun: error:" in err and "$.properties.a.not: not is not enforced" in err, err
    assert not (tmp_path / "out").exists()


def test_unenforced_keyword_in_a_row_is_that_rows_error(chat_model_dir, engine, tmp_path):
    """Per row, a schema with a refused keyword is an error row naming keyword and path; the others run."""
    schemas = [SCHEMA, {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, SCHEMA]
    pq.write_table(
        pa.table({"prompt": ["a", "b", "c"], "structured_outputs": [json.dumps({"json": s}) for s in schemas]}),
        tmp_path / "in.parquet",
    )
    summary = run_job(
        manifest(chat_model_dir, tmp_path / "in.parquet", tmp_path / "out", SamplingParams(max_new_tokens=200)),
        progress=False,
        engine=engine,
    )
    rows = sorted(read_output(tmp_path / "out").to_pylist(), key=lambda r: r["row_index"])
    assert summary.num_errors == 1
    assert "$.uniqueItems: uniqueItems is not enforced" in rows[1]["error"], rows[1]
    assert rows[1]["finish_reason"] == "error" and rows[1]["completion"] is None
    for row in (rows[0], rows[2]):
        assert row["error"] is None and row["structured_output_valid"] is True, row


def test_backend_setting_refuses_at_load_what_its_engine_would_not_enforce(chat_model_dir, tmp_path):
    """``engine.structured_outputs_backend``: auto serves a multi-branch allOf with llguidance; xgrammar alone
    refuses it at load, by keyword and path."""
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}
    toml = tmp_path / "job.toml"
    body = (
        f'[model]\npath = "{chat_model_dir}"\n[input]\npath = "in.parquet"\nprompt_column = "p"\n'
        f'[output]\npath = "out"\n[sampling]\nmax_tokens = 8\n'
        f"[sampling.structured_outputs]\njson = '{json.dumps(schema)}'\n"
    )
    toml.write_text(body)
    assert load_manifest(toml).engine.structured_outputs_backend == "auto"
    toml.write_text(body + '[engine]\nstructured_outputs_backend = "xgrammar"\n')
    with pytest.raises(ValueError, match=r"\$\.allOf: allOf is not enforced with more than one branch \[xgrammar\]"):
        load_manifest(toml)
    toml.write_text(body + '[engine]\nstructured_outputs_backend = "outlines"\n')
    with pytest.raises(ValueError, match="structured_outputs_backend must be one of"):
        load_manifest(toml)
