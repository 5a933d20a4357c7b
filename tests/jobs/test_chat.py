"""Chat mode: the tokenizer's chat template over a prompt column or a messages column, the system prompt, row
errors, the setup error for a tokenizer without a template, and the shipped MT-Bench chat manifest."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SamplingParams
from cbrun.jobs.config.manifest import JobManifest, load_manifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import JobError, run_job
from tests.jobs.cli_args import run_argv

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=256, max_requests_per_batch=8, num_blocks=64)
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@pytest.fixture(scope="module")
def chat_engine(chat_model_dir):
    from cbrun.engine import LLMEngine

    return LLMEngine.from_pretrained(str(chat_model_dir), ENGINE_CONFIG)


def chat_manifest(model_dir, input_path, output_dir, **input_settings) -> JobManifest:
    input_settings = {"chat": True, **input_settings}
    if "messages_column" not in input_settings and "template" not in input_settings:
        input_settings.setdefault("prompt_column", "prompt")
    return JobManifest(
        model=ModelSettings(path=str(model_dir)),
        input=InputSettings(path=str(input_path), **input_settings),
        sampling=SamplingParams(max_new_tokens=4),
        engine=ENGINE_CONFIG,
        output=OutputSettings(path=str(output_dir)),
    )


def by_index(output_dir) -> dict[int, dict]:
    return {row["row_index"]: row for row in read_output(output_dir).to_pylist()}


def rendered_ids(tok, turns: list[tuple[str, str]]) -> list[int]:
    """The template rendered by hand: BOS, then every byte of the turns and the assistant header."""
    text = "".join(f"<|{role}|>\n{content}\n" for role, content in turns) + "<|assistant|>\n"
    return [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)


def greedy(engine, ids: list[int]) -> list[int]:
    return list(engine.generate([(0, ids, SamplingParams(max_new_tokens=4))]))[0].output_token_ids


def test_prompt_column_becomes_one_user_turn_after_the_system_prompt(chat_model_dir, chat_engine, tmp_path):
    tok = chat_engine.tokenizer
    pq.write_table(pa.table({"prompt": ["hello", "what is 2+2?"]}), tmp_path / "in.parquet")
    run_job(
        chat_manifest(chat_model_dir, tmp_path / "in.parquet", tmp_path / "out", system_prompt="Be brief."),
        progress=False,
        engine=chat_engine,
    )
    out = by_index(tmp_path / "out")
    for i, prompt in enumerate(["hello", "what is 2+2?"]):
        ids = rendered_ids(tok, [("system", "Be brief."), ("user", prompt)])
        assert out[i]["num_prompt_tokens"] == len(ids)
        assert out[i]["completion_token_ids"] == greedy(chat_engine, ids)


def test_messages_column(chat_model_dir, chat_engine, tmp_path):
    tok = chat_engine.tokenizer
    conversations = [
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"},
        ],
        [{"role": "system", "content": "Own system."}, {"role": "user", "content": "x"}],
        None,
        [],
        [{"role": "user", "content": None}],
    ]
    pq.write_table(
        pa.table({"id": [f"c{i}" for i in range(5)], "messages": pa.array(conversations, MESSAGES_TYPE)}),
        tmp_path / "in.parquet",
    )
    summary = run_job(
        chat_manifest(
            chat_model_dir,
            tmp_path / "in.parquet",
            tmp_path / "out",
            id_column="id",
            messages_column="messages",
            system_prompt="Default system.",
        ),
        progress=False,
        engine=chat_engine,
    )
    assert (summary.num_rows, summary.num_errors) == (5, 3)
    out = by_index(tmp_path / "out")
    want = [
        rendered_ids(tok, [("system", "Default system."), ("user", "hi"), ("assistant", "hello"), ("user", "bye")]),
        rendered_ids(tok, [("system", "Own system."), ("user", "x")]),
    ]  # a system turn is not doubled
    for i in (0, 1):
        assert out[i]["num_prompt_tokens"] == len(want[i])
        assert out[i]["completion_token_ids"] == greedy(chat_engine, want[i])
    assert out[2]["error"] == "row 2 (id 'c2'): messages column is null"
    assert out[3]["error"] == "row 3 (id 'c3'): messages column holds no turns"
    assert out[4]["error"] == "row 4 (id 'c4'): messages turn 0 has a null role or content"


def test_tokenizer_without_chat_template_is_a_setup_error(tiny_model_dir, tmp_path, capsys):
    from cbrun.jobs.cli import main

    pq.write_table(pa.table({"prompt": ["hello"]}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match="has no chat template; use a chat .* --model PATH"):
        run_job(chat_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out"), progress=False)
    code = main(
        [
            *run_argv(str(tiny_model_dir), str(tmp_path / "in.parquet"), str(tmp_path / "out")),
            "--prompt-column",
            "prompt",
            "--set",
            "input.chat=true",
            "--no-progress",
        ]
    )
    assert code == 2 and "has no chat template" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_chat_settings_are_checked(chat_model_dir, tmp_path):
    with pytest.raises(ValueError, match="need input.chat = true"):
        InputSettings(path="in", prompt_column="p", system_prompt="s")
    with pytest.raises(ValueError, match="exactly one of"):
        InputSettings(path="in", prompt_column="p", messages_column="m", chat=True)
    with pytest.raises(ValueError, match="not input.prompt_ids_column"):
        InputSettings(path="in", prompt_ids_column="ids", chat=True)
    pq.write_table(pa.table({"messages": [["just text"]]}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match="messages_column 'messages' .* must be a list of structs"):
        run_job(
            chat_manifest(chat_model_dir, tmp_path / "in.parquet", tmp_path / "out", messages_column="messages"),
            progress=False,
        )


def test_mt_bench_manifest_first_turn_through_the_template(
    chat_model_dir, chat_engine, shared_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(REPO_ROOT)  # the manifest's relative paths are written for the repository root
    manifest = load_manifest(
        REPO_ROOT / "manifests" / "mt-bench-chat.toml",
        sets=["sampling.max_new_tokens=3", "engine.device=cpu", "engine.dtype=float32"],
        overrides={
            "model": {"path": str(chat_model_dir)},
            "input": {"limit": 2},
            "output": {"path": str(tmp_path / "out")},
        },
    )
    inp = manifest.input
    assert (inp.template, inp.chat, inp.id_column) == ("{turns[0]}", True, "question_id")
    summary = run_job(manifest, progress=False, engine=chat_engine)
    assert (summary.num_rows, summary.num_errors) == (2, 1)
    questions = pq.read_table(shared_dir / "data" / "mt_bench_questions.parquet").slice(0, 2).to_pylist()
    out = by_index(tmp_path / "out")
    ids = rendered_ids(chat_engine.tokenizer, [("system", inp.system_prompt), ("user", questions[0]["turns"][0])])
    assert out[0]["id"] == str(questions[0]["question_id"])
    assert out[0]["num_prompt_tokens"] == len(ids) and out[0]["num_completion_tokens"] == 3
    # the second question (250 bytes) does not fit the byte-level test model's 256 tokens once templated
    assert "maximum length is 256" in out[1]["error"]
