"""Job sampling settings: every SamplingParams field from the manifest and from a row column, per-row overrides
reaching the engine, stop_reason, invalid values as row errors naming the setting, prompt_logprobs on request."""

from __future__ import annotations

from dataclasses import fields

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.engine.config import EngineConfig
from cbrun.engine.sampling_params import SAMPLING_FIELD_TYPES, SAMPLING_FIELDS, SamplingParams
from cbrun.engine.structured_output import StructuredOutputsParams
from cbrun.jobs.config.manifest import manifest_from_dict
from cbrun.jobs.input.reader import PromptReader
from cbrun.jobs.modes.generate import derive_seed
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import run_job

ENGINE_CONFIG = EngineConfig(page_size=16, max_batch_tokens=256, max_requests_per_batch=8, num_blocks=64)
DEFAULTS = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)
MANIFEST_DEFAULTS = {"sampling": DEFAULTS, "id_column": "id"}


def by_index(output_dir) -> dict[int, dict]:
    return {row["row_index"]: row for row in read_output(output_dir).to_pylist()}


def direct(engine, prompt: str, params: SamplingParams):
    """The engine's output for one prompt, run directly (the oracle for what the job should ask for)."""
    return list(engine.generate([(0, engine.tokenizer.encode(prompt), params)]))[0]


def test_every_sampling_field_is_a_manifest_setting():
    values = {
        "max_new_tokens": 7,
        "min_new_tokens": 2,
        "temperature": 0.5,
        "top_k": 3,
        "top_p": 0.9,
        "min_p": 0.1,
        "stop_token_ids": [4, 5],
        "stop": ["\n\n", "END"],
        "ignore_eos": True,
        "repetition_penalty": 1.2,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "logprobs": 2,
        "prompt_logprobs_from": 3,
        "include_stop_str_in_output": True,
        "logprobs_mode": "processed_logprobs",
        "structured_outputs": {"regex": "a+"},
    }
    assert set(values) | {"seed"} == {f.name for f in fields(SamplingParams)} == set(SAMPLING_FIELDS)
    raw = {
        "model": {"path": "m"},
        "input": {"path": "i", "prompt_column": "p"},
        "output": {"path": "o"},
        "sampling": {**values, "seed": 11},
    }
    m = manifest_from_dict(raw)
    expected = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    expected["structured_outputs"] = StructuredOutputsParams(regex="a+")
    assert {k: getattr(m.sampling, k) for k in values} == expected
    assert m.seed == 11 and m.sampling.seed is None  # the job seed; each row's seed derives from it


def test_prompt_logprobs_setting_is_shorthand_for_prompt_logprobs_from_1():
    raw = {"model": {"path": "m"}, "input": {"path": "i", "prompt_column": "p"}, "output": {"path": "o"}}
    assert manifest_from_dict({**raw, "sampling": {"prompt_logprobs": True}}).sampling.prompt_logprobs_from == 1
    assert manifest_from_dict({**raw, "sampling": {"prompt_logprobs": False}}).sampling.prompt_logprobs_from is None
    with pytest.raises(ValueError, match="not both"):
        manifest_from_dict({**raw, "sampling": {"prompt_logprobs": True, "prompt_logprobs_from": 2}})
    with pytest.raises(ValueError, match="prompt_logprobs must be true or false"):
        manifest_from_dict({**raw, "sampling": {"prompt_logprobs": 1}})


def test_every_sampling_field_is_a_row_column_of_its_arrow_type(tmp_path):
    columns = {
        "prompt": pa.array(["a", "b"]),
        "max_new_tokens": pa.array([3, None], pa.int32()),
        "min_new_tokens": pa.array([1.0, None]),  # int as float
        "temperature": pa.array([0, None], pa.int64()),  # a number as an int
        "top_k": pa.array([2, None], pa.int16()),
        "top_p": pa.array([0.5, None], pa.float32()),
        "min_p": pa.array([0.25, None]),
        "seed": pa.array([2**62, None], pa.int64()),
        "ignore_eos": pa.array([True, None]),
        "stop_token_ids": pa.array([[1, 2], None], pa.list_(pa.int64())),
        "stop": pa.array(["END", None]),
        "repetition_penalty": pa.array([1.5, None]),
        "presence_penalty": pa.array([-0.5, None]),
        "frequency_penalty": pa.array([0.5, None]),
        "logprobs": pa.array([0, None], pa.int8()),
        "prompt_logprobs_from": pa.array([1, None], pa.int64()),
        "include_stop_str_in_output": pa.array([True, None]),
        "logprobs_mode": pa.array(["raw_logprobs", None]),
        "structured_outputs": pa.array(
            [{"choice": ["x", "y"], "regex": None}, None],
            pa.struct([("choice", pa.list_(pa.string())), ("regex", pa.string())]),
        ),
    }
    pq.write_table(pa.table(columns), tmp_path / "in.parquet")
    reader = PromptReader(tmp_path / "in.parquet", prompt_column="prompt")
    assert sorted(reader.sampling_columns) == sorted(SAMPLING_FIELDS)
    first, second = reader.iter_rows()
    assert first.sampling_overrides == {
        "max_new_tokens": 3,
        "min_new_tokens": 1,
        "temperature": 0.0,
        "top_k": 2,
        "top_p": 0.5,
        "min_p": 0.25,
        "seed": 2**62,
        "ignore_eos": True,
        "stop_token_ids": (1, 2),
        "stop": ("END",),
        "repetition_penalty": 1.5,
        "presence_penalty": -0.5,
        "frequency_penalty": 0.5,
        "logprobs": 0,
        "prompt_logprobs_from": 1,
        "include_stop_str_in_output": True,
        "logprobs_mode": "raw_logprobs",
        "structured_outputs": StructuredOutputsParams(choice=("x", "y")),
    }
    python_types = {
        "int": int,
        "float": float,
        "bool": bool,
        "tuple[int, ...]": tuple,
        "tuple[str, ...]": tuple,
        "str": str,
        "StructuredOutputsParams": StructuredOutputsParams,
    }
    assert {k: type(v) for k, v in first.sampling_overrides.items()} == {
        k: python_types[SAMPLING_FIELD_TYPES[k].replace(" | None", "")] for k in SAMPLING_FIELDS
    }
    SamplingParams().replace(**first.sampling_overrides).validate()
    assert second.sampling_overrides == {} and second.error is None  # null cells keep the job's defaults

    stop_lists = pa.array([["a", "bc"], []], pa.list_(pa.string()))
    pq.write_table(pa.table({"prompt": ["a", "b"], "stop": stop_lists}), tmp_path / "lists.parquet")
    rows = list(PromptReader(tmp_path / "lists.parquet", prompt_column="prompt").iter_rows())
    assert [r.sampling_overrides["stop"] for r in rows] == [("a", "bc"), ()]


def test_wrong_typed_row_values_are_row_errors_naming_the_setting(tmp_path):
    pq.write_table(
        pa.table(
            {
                "prompt": ["a", "b", "c", "d"],
                "top_k": [1.0, 2.5, None, None],
                "ignore_eos": pa.array([None, None, None, None], pa.bool_()),
                "stop_token_ids": pa.array([None, None, [-1], None], pa.list_(pa.int64())),
                "stop": pa.array([None, None, None, ["x", None]], pa.list_(pa.string())),
            }
        ),
        tmp_path / "in.parquet",
    )
    rows = list(PromptReader(tmp_path / "in.parquet", prompt_column="prompt").iter_rows())
    assert rows[0].error is None and rows[0].sampling_overrides == {"top_k": 1}
    assert rows[1].error == "row 1 (id '1'): top_k must be an integer, got 2.5"
    assert rows[2].error.startswith("row 2 (id '2'): stop_token_ids must be a list of token ids >= 0")
    assert rows[3].error.startswith("row 3 (id '3'): stop must be a string or a list of strings")


def test_per_row_overrides_reach_the_engine(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    prompts = [f"row {i} says" for i in range(9)]
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    first_token = direct(tiny_engine, prompts[4], greedy).output_token_ids[0]
    long_text = tiny_engine.tokenizer.decode(
        direct(tiny_engine, prompts[5], greedy.replace(max_new_tokens=16)).output_token_ids
    )
    cut = next(
        k
        for k in range(1, len(long_text))
        if long_text[k].isprintable() and long_text[k] not in long_text[:k] and long_text[k] != "\ufffd"
    )
    none = [None] * 9
    table = pa.table(
        {
            "id": [f"r{i}" for i in range(9)],
            "prompt": prompts,
            "temperature": pa.array([0.0, None, None, None, 0.0, 0.0, None, 0.0, 0.0]),
            "max_new_tokens": pa.array([None, 0, 1, None, None, 16, None, None, None], pa.int64()),
            "top_p": pa.array([None, None, None, 0.0, None, None, None, None, None]),
            "stop_token_ids": pa.array(
                [None, None, None, None, [first_token], None, None, None, None], pa.list_(pa.int64())
            ),
            "stop": pa.array([None] * 5 + [long_text[cut]] + [None] * 3, pa.string()),
            "logprobs": pa.array([None] * 7 + [2, None], pa.int64()),
            "repetition_penalty": pa.array([None] * 8 + [1.5]),
            "ignore_eos": pa.array(none, pa.bool_()),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=4)
    summary = run_job(
        make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out"), progress=False, engine=tiny_engine
    )
    assert (summary.num_rows, summary.num_errors) == (9, 1)
    out = by_index(tmp_path / "out")

    # temperature 0 in a temperature-1 job: the greedy completion
    assert out[0]["completion_token_ids"] == direct(tiny_engine, prompts[0], greedy).output_token_ids
    assert (out[1]["completion"], out[1]["completion_token_ids"], out[1]["finish_reason"]) == ("", [], "length")
    assert out[2]["num_completion_tokens"] == 1 and out[2]["finish_reason"] == "length"
    # an invalid value is that row's error, naming the row and the setting; the other rows succeed
    assert out[3]["finish_reason"] == "error"
    assert out[3]["error"] == "row 3 (id 'r3'): top_p must be in (0, 1], got 0.0"
    assert all(out[i]["error"] is None for i in out if i != 3)
    # a stop token id: finish "stop", the id kept in the output and named in stop_reason
    assert (out[4]["completion_token_ids"], out[4]["finish_reason"], out[4]["stop_reason"]) == (
        [first_token],
        "stop",
        str(first_token),
    )
    # a stop string: the completion cut before it, stop_reason the string
    assert (out[5]["completion"], out[5]["finish_reason"], out[5]["stop_reason"]) == (
        long_text[:cut],
        "stop",
        long_text[cut],
    )
    # all-null overrides: the job's defaults, with the row's derived seed
    want = direct(tiny_engine, prompts[6], DEFAULTS.replace(seed=derive_seed(0, "r6"))).output_token_ids
    assert out[6]["completion_token_ids"] == want and out[6]["stop_reason"] is None
    assert len(out[7]["logprobs"]) == 6 and all(out[i]["logprobs"] is None for i in out if i != 7)
    penalised = direct(tiny_engine, prompts[8], greedy.replace(repetition_penalty=1.5)).output_token_ids
    assert out[8]["completion_token_ids"] == penalised


def test_prompt_logprobs_reach_the_output(tiny_model_dir, tiny_engine, tmp_path, make_manifest):
    import torch
    from transformers import AutoModelForCausalLM

    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["hello there", "x"]}), tmp_path / "in.parquet")
    sampling = manifest_from_dict(
        {
            "model": {"path": "m"},
            "input": {"path": "i", "prompt_column": "p"},
            "output": {"path": "o"},
            "sampling": {"prompt_logprobs": True, "max_new_tokens": 2},
        }
    ).sampling
    run_job(
        make_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", sampling=sampling),
        progress=False,
        engine=tiny_engine,
    )
    out = by_index(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for i, prompt in enumerate(["hello there", "x"]):
        ids = tiny_engine.tokenizer.encode(prompt)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        want = [float(logprobs[p - 1, ids[p]]) for p in range(1, len(ids))]  # the first token has no prediction
        assert out[i]["prompt_logprobs"] == pytest.approx(want, abs=1e-4)
        assert len(out[i]["prompt_greedy"]) == out[i]["num_prompt_tokens"] - 1
