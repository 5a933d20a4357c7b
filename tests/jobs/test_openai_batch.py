"""OpenAI batch files in and out: request parsing, a mixed chat / completions / bad-line batch whose results.jsonl
lines parse with the ``openai`` package's own types, parity with a Parquet manifest, repeated custom_ids refused,
``cbrun export``, and a SIGKILL mid-job followed by a rerun."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.cli import main
from cbrun.jobs.config.manifest import JobManifest, load_manifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from cbrun.jobs.input.openai_request import parse_request
from cbrun.jobs.output.export import token_logprobs
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import JobError, run_job
from tests.jobs.cli_args import run_argv
from tests.jobs.test_chat import rendered_ids
from tests.jobs.test_resume import cbrun_command, kill_after_first_commit

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=256, max_requests_per_batch=8, num_blocks=64)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LINE_KEYS = {"id", "custom_id", "response", "error"}


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    from cbrun.engine import LLMEngine

    return LLMEngine.from_pretrained(str(chat_model_dir), ENGINE_CONFIG)


def request(custom_id, url, body, method="POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def batch_manifest(model_dir, input_path, output_dir, **output) -> JobManifest:
    return JobManifest(
        model=ModelSettings(path=str(model_dir)),
        input=InputSettings(path=str(input_path)),
        sampling=SamplingParams(max_new_tokens=4),
        engine=ENGINE_CONFIG,
        output=OutputSettings(path=str(output_dir), format="openai-batch", **output),
    )


def read_results(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "_results.jsonl").read_text().splitlines()]


def greedy(engine, ids: list[int], max_new_tokens: int) -> list[int]:
    return list(engine.generate([(0, ids, SamplingParams(max_new_tokens=max_new_tokens))]))[0].output_token_ids


# --- request parsing ---------------------------------------------------------------------------------------------


def test_body_sampling_fields_map_onto_cbrun_settings():
    parsed = parse_request(
        "POST",
        CHAT,
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                ],
                "max_completion_tokens": 7,
                "temperature": 0.5,
                "top_p": 0.9,
                "n": 3,
                "stop": ["x", "y"],
                "seed": 11,
                "presence_penalty": 0.25,
                "frequency_penalty": -0.5,
                "logprobs": True,
                "top_logprobs": 2,
                "top_k": 5,
                "min_p": 0.1,
                "repetition_penalty": 1.2,
                "min_tokens": 1,
                "ignore_eos": True,
                "stream": False,
                "user": "u",
                "logit_bias": None,
            }
        ),
    )
    assert parsed.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert parsed.model == "m" and parsed.num_samples == 3 and parsed.top_logprobs == 2
    assert parsed.overrides == {
        "max_new_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ("x", "y"),
        "seed": 11,
        "presence_penalty": 0.25,
        "frequency_penalty": -0.5,
        "logprobs": 2,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "min_new_tokens": 1,
        "ignore_eos": True,
    }
    completion = parse_request("POST", COMPLETIONS, {"prompt": [[1, 2, 3]], "max_tokens": 2, "logprobs": 0})
    assert (completion.prompt, completion.prompt_token_ids) == (None, [1, 2, 3])
    assert completion.overrides == {"max_new_tokens": 2, "logprobs": 0} and completion.top_logprobs == 0
    assert parse_request(None, COMPLETIONS, {"prompt": "Once"}).prompt == "Once"


@pytest.mark.parametrize(
    "method, url, body, message",
    [
        ("POST", "/v1/embeddings", {"input": "x"}, "url '/v1/embeddings' is not supported"),
        ("GET", COMPLETIONS, {"prompt": "x"}, "method 'GET' is not supported"),
        ("POST", CHAT, None, "the request has no body"),
        ("POST", CHAT, "{not json", "body is not valid JSON"),
        ("POST", CHAT, {"max_tokens": 3}, "body.messages is missing"),
        ("POST", COMPLETIONS, {"max_tokens": 3}, "body.prompt is missing"),
        ("POST", COMPLETIONS, {"prompt": ["a", "b"]}, "body.prompt holds 2 prompts"),
        (
            "POST",
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "body.tools = .* is not supported by cbrun",
        ),
        (
            "POST",
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "grammar"}},
            "body.response_format = .* is not supported",
        ),
        (
            "POST",
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "body.response_format.json_schema.schema must be",
        ),
        (
            "POST",
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "guided_json": {}},
            "body field 'guided_json' is not supported by cbrun",
        ),
        (
            "POST",
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            "body.temperature: temperature must be a number",
        ),
        (
            "POST",
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "body.top_logprobs needs body.logprobs = true",
        ),
        (
            "POST",
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            r"body.messages\[0\].content must be text",
        ),
        ("POST", COMPLETIONS, {"prompt": "x", "n": 0}, "body.n: n .* must be an integer >= 1"),
        (
            "POST",
            COMPLETIONS,
            {"prompt": "x", "max_tokens": 2, "max_completion_tokens": 3},
            "max_tokens and body.max_completion_tokens differ",
        ),
    ],
)
def test_bad_requests_name_the_field(method, url, body, message):
    with pytest.raises(ValueError, match=message):
        parse_request(method, url, body)


# --- jobs --------------------------------------------------------------------------------------------------------

MIXED = [
    request(
        "chat-1",
        CHAT,
        {
            "model": "tiny-chat",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    request(
        "cmpl-1",
        COMPLETIONS,
        {"prompt": "Once upon", "max_tokens": 4, "n": 2, "temperature": 0.8, "ignore_eos": True, "logprobs": 1},
    ),
    '{"custom_id": "broken", this is not JSON',
    request("cmpl-ids", COMPLETIONS, {"prompt": [5, 6, 7], "max_completion_tokens": 3}),
    request("embed", "/v1/embeddings", {"input": "x"}),
    request(
        "chat-2",
        CHAT,
        {
            "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
            "max_tokens": 3,
            "logit_bias": {"5": 1},
        },
    ),
    request("chat-3", CHAT, {"messages": [{"role": "user", "content": "Bye"}], "ignore_eos": True}),
]


def test_mixed_batch_results_parse_with_openai_types_in_input_order(chat_model_dir, engine, tmp_path):
    path = write_jsonl(tmp_path / "batch.jsonl", MIXED)
    summary = run_job(
        batch_manifest(chat_model_dir, path, tmp_path / "out", keep_columns=["body"]), progress=False, engine=engine
    )
    assert (summary.num_rows, summary.num_errors) == (7, 3)
    lines = read_results(tmp_path / "out")
    assert [line["custom_id"] for line in lines] == ["chat-1", "cmpl-1", None, "cmpl-ids", "embed", "chat-2", "chat-3"]
    assert len({line["id"] for line in lines}) == 7
    for line in lines:
        assert set(line) == LINE_KEYS
        assert set(line["response"]) == {"status_code", "request_id", "body"}
    bodies = {}
    for line in lines:
        if line["error"] is None:
            assert line["response"]["status_code"] == 200
            body = line["response"]["body"]
            kind = ChatCompletion if body["object"] == "chat.completion" else Completion
            bodies[line["custom_id"]] = kind.model_validate(body)
        else:
            assert line["response"] == {"status_code": 400, "request_id": line["response"]["request_id"], "body": None}
            assert set(line["error"]) == {"code", "message"}
    errors = {line["custom_id"]: line["error"]["message"] for line in lines if line["error"]}
    assert errors[None].startswith("row 2 (id '2', line 3 of batch.jsonl): the line is not valid JSON")
    assert errors["embed"].startswith("row 4 (custom_id 'embed', line 5 of batch.jsonl): url '/v1/embeddings' is not")
    assert "body.logit_bias" in errors["chat-2"]

    tok = engine.tokenizer
    chat = bodies["chat-1"]
    assert isinstance(chat, ChatCompletion) and chat.model == "tiny-chat" and len(chat.choices) == 1
    ids = greedy(engine, rendered_ids(tok, [("user", "Hi")]), 5)
    assert chat.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    assert chat.usage.prompt_tokens == len(rendered_ids(tok, [("user", "Hi")]))
    assert chat.usage.completion_tokens == len(ids) and chat.usage.total_tokens == chat.usage.prompt_tokens + len(ids)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(ids) and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy picks the most likely token

    cmpl = bodies["cmpl-1"]
    assert isinstance(cmpl, Completion) and cmpl.model == chat_model_dir.name
    assert [c.index for c in cmpl.choices] == [0, 1] and cmpl.usage.completion_tokens == 8
    assert all(len(c.logprobs.tokens) == 4 and len(c.logprobs.top_logprobs[0]) == 1 for c in cmpl.choices)
    assert bodies["cmpl-ids"].usage.prompt_tokens == 3
    assert bodies["chat-3"].choices[0].logprobs is None and bodies["chat-3"].usage.completion_tokens == 4

    # The parts stay the record: each row once; export writes the same file again.
    assert sorted(read_output(tmp_path / "out").column("row_index").to_pylist()) == [0, 1, 1, 2, 3, 4, 5, 6]
    first = (tmp_path / "out" / "_results.jsonl").read_bytes()
    assert main(["export", str(tmp_path / "out"), "--to", str(tmp_path / "again.jsonl")]) == 0
    assert (tmp_path / "again.jsonl").read_bytes() == first
    assert main(["export", str(tmp_path / "out"), "--format", "jsonl"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "_output.jsonl").read_text().splitlines()]
    assert [(r["row_index"], r["sample_index"]) for r in rows] == [
        (0, 0),
        (1, 0),
        (1, 1),
        (2, 0),
        (3, 0),
        (4, 0),
        (5, 0),
        (6, 0),
    ]
    assert rows[0]["custom_id"] == "chat-1" and rows[0]["url"] == CHAT
    assert json.loads(rows[0]["body"]) == MIXED[0]["body"]  # the request body kept as JSON text
    assert read_output(tmp_path / "out").num_rows == 8
    # The JSON Lines files start with "_": the folder stays a data set for pyarrow's and pandas' readers.
    assert pq.read_table(tmp_path / "out").num_rows == 8
    assert pandas.read_parquet(tmp_path / "out").shape[0] == 8


def test_token_logprobs_reads_maps_and_structs():
    assert token_logprobs([(5, -0.5), (7, -1.25)]) == {5: -0.5, 7: -1.25}
    assert token_logprobs([{"token_id": 5, "logprob": -0.5}]) == {5: -0.5}
    assert token_logprobs({3: -2.0}) == {3: -2.0}


def test_batch_file_and_parquet_manifest_give_the_same_token_ids(chat_model_dir, engine, tmp_path):
    prompts = ["Once upon a time", "The little dog", "A", "Hello there, how are"]
    max_tokens = [6, 3, 5, 4]
    path = write_jsonl(
        tmp_path / "batch.jsonl",
        [
            request(f"q{i}", COMPLETIONS, {"prompt": p, "max_tokens": m, "temperature": 0.7, "top_k": 20})
            for i, (p, m) in enumerate(zip(prompts, max_tokens))
        ],
    )
    pq.write_table(
        pa.table(
            {
                "id": [f"q{i}" for i in range(4)],
                "prompt": prompts,
                "max_new_tokens": max_tokens,
                "temperature": [0.7] * 4,
                "top_k": [20] * 4,
            }
        ),
        tmp_path / "in.parquet",
    )
    run_job(batch_manifest(chat_model_dir, path, tmp_path / "batch"), progress=False, engine=engine)
    manifest = JobManifest(
        model=ModelSettings(path=str(chat_model_dir)),
        input=InputSettings(path=str(tmp_path / "in.parquet"), prompt_column="prompt", id_column="id"),
        sampling=SamplingParams(max_new_tokens=4),
        engine=ENGINE_CONFIG,
        output=OutputSettings(path=str(tmp_path / "parquet")),
    )
    run_job(manifest, progress=False, engine=engine)
    batch = {r["id"]: r["completion_token_ids"] for r in read_output(tmp_path / "batch").to_pylist()}
    parquet = {r["id"]: r["completion_token_ids"] for r in read_output(tmp_path / "parquet").to_pylist()}
    assert batch == parquet and [len(batch[f"q{i}"]) for i in range(4)] == max_tokens


def test_repeated_custom_ids_are_refused_before_any_work(chat_model_dir, tmp_path):
    body = {"prompt": "x"}
    path = write_jsonl(
        tmp_path / "batch.jsonl",
        [
            request("a", COMPLETIONS, body),
            request("b", COMPLETIONS, body),
            request("a", COMPLETIONS, body),
            request("b", COMPLETIONS, body),
            request("c", COMPLETIONS, body),
        ],
    )
    with pytest.raises(JobError, match=r"custom_id values repeat .*'a' \(2 lines\), 'b' \(2 lines\); each request"):
        run_job(batch_manifest(chat_model_dir, path, tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_forced_format_and_flags(chat_model_dir, tmp_path, capsys):
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "in.parquet")
    args = [
        "run",
        "--no-progress",
        "--model",
        str(chat_model_dir),
        "--input",
        str(tmp_path / "in.parquet"),
        "--output",
        str(tmp_path / "out"),
        "--input-format",
        "openai-batch",
    ]
    assert main(args) == 2
    assert (
        "read as OpenAI batch requests, but its first line has no custom_id, method, url, body"
        in capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="openai-batch.* leave out input.prompt_column"):
        load_manifest(
            None,
            [],
            {
                "model": {"path": "m"},
                "output": {"path": "o"},
                "input": {"path": "x", "format": "openai-batch", "prompt_column": "p"},
            },
        )
    manifest = load_manifest(
        None,
        [],
        {
            "model": {"path": "m"},
            "input": {"path": "x"},
            "output": {"path": "o", "format": "openai-batch", "keep_columns": ["a"]},
        },
    )
    assert manifest.output.keep_columns == ["a"] and manifest.input.format == "auto"
    assert main(["export", str(tmp_path)]) == 2
    assert "holds no cbrun job (no job.json)" in capsys.readouterr().err


@pytest.mark.slow
def test_killed_batch_job_reruns_to_complete_results(chat_model_dir, tmp_path):
    num_requests = 12
    path = write_jsonl(
        tmp_path / "batch.jsonl",
        [
            request(
                f"r{i}",
                CHAT if i % 2 else COMPLETIONS,
                {"messages": [{"role": "user", "content": f"question {i}"}]} if i % 2 else {"prompt": f"prompt {i}"},
            )
            for i in range(num_requests)
        ],
    )
    out = tmp_path / "out"
    sets = [
        "engine.max_requests_per_batch=2",
        "engine.max_batch_tokens=64",
        "engine.num_blocks=32",
        "engine.num_threads=1",
        "sampling.ignore_eos=true",
        "output.commit_every_rows=2",
    ]
    args = [
        *run_argv(str(chat_model_dir), str(path), str(out)),
        "--max-new-tokens",
        "8",
        "--output-format",
        "openai-batch",
        "--no-progress",
        *[a for s in sets for a in ("--set", s)],
    ]
    kill_after_first_commit(args, out)
    assert not (out / "_results.jsonl").exists()
    resumed = subprocess.run(cbrun_command() + args, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    lines = read_results(out)
    assert [line["custom_id"] for line in lines] == [f"r{i}" for i in range(num_requests)]
    assert all(line["error"] is None and len(line["response"]["body"]["choices"]) == 1 for line in lines)
    reference = subprocess.run(
        cbrun_command() + [a if a != str(out) else str(tmp_path / "ref") for a in args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stderr
    choices = [line["response"]["body"]["choices"] for line in lines]
    assert choices == [line["response"]["body"]["choices"] for line in read_results(tmp_path / "ref")]


def test_chat_requests_need_a_chat_template_before_any_work(tiny_model_dir, tmp_path):
    chat_body = {"messages": [{"role": "user", "content": "x"}]}
    path = write_jsonl(
        tmp_path / "batch.jsonl", [request("a", COMPLETIONS, {"prompt": "x"}), request("b", CHAT, chat_body)]
    )
    with pytest.raises(
        JobError, match="the batch has 1 /v1/chat/completions requests, but the tokenizer in .* has no chat template"
    ):
        run_job(batch_manifest(tiny_model_dir, path, tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_completion_logprob_tokens_join_to_the_text(stories260k_dir):
    """SentencePiece tokens decoded one by one lose their leading space; in context they keep it, so the
    tokens join to the completion and every text_offset points at its token."""
    from transformers import AutoTokenizer

    from cbrun.jobs.output.export import _ResultFormatter

    tokenizer = AutoTokenizer.from_pretrained(str(stories260k_dir))
    ids = tokenizer.encode("Once upon a time, there was a little girl", add_special_tokens=False)[3:]
    text = tokenizer.decode(ids)
    row = {"completion_token_ids": ids, "logprobs": [[{"token_id": i, "logprob": -1.0}] for i in ids]}
    formatter = _ResultFormatter("h", "m", tokenizer)
    logprobs = formatter.logprobs(row, None, chat=False)
    assert "".join(logprobs["tokens"]) == text and " there" in logprobs["tokens"]
    assert all(text[offset:].startswith(token) for offset, token in zip(logprobs["text_offset"], logprobs["tokens"]))
    content = formatter.logprobs(row, None, chat=True)["content"]
    assert "".join(entry["token"] for entry in content) == text
