"""Issue 14 §3 (job): BOS added once, generation_config.json sampling defaults for what the job does not set, a
stop token's text out of ``completion``, and ``max_new_tokens = 0`` with prompt logprobs (echo)."""

from __future__ import annotations

import copy
import json
import logging
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbrun.jobs.config.manifest import load_manifest
from cbrun.jobs.input.prompts import encode_prompt
from cbrun.jobs.model.defaults import model_sampling_defaults
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import JobError, run_job

ENGINE_SETS = ["engine.page_size=16", "engine.num_blocks=64", "engine.max_batch_tokens=256"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    """The tiny model in a directory of the test's own, so its generation_config.json can change."""
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def manifest(model_dir, input_path, output_dir, sets=()):
    return load_manifest(
        None,
        [*ENGINE_SETS, *sets],
        {
            "model": {"path": str(model_dir)},
            "input": {"path": str(input_path), "prompt_column": "p"},
            "output": {"path": str(output_dir)},
        },
    )


def rows_of(output_dir) -> list[dict]:
    return read_output(output_dir).sort_by("row_index").to_pylist()


def test_a_prompt_that_begins_with_bos_gets_no_second_one(tiny_model_dir, tokenizer, tmp_path, caplog):
    bos = tokenizer.bos_token_id
    assert tokenizer.encode("<s>Once") == [bos, bos, *tokenizer.encode("Once")[1:]]  # the fault
    assert encode_prompt(tokenizer, "<s>Once") == tokenizer.encode("Once") == [bos, *tokenizer.encode("Once")[1:]]
    assert encode_prompt(tokenizer, "Once <s>") == tokenizer.encode("Once <s>")  # only a leading BOS counts
    pq.write_table(pa.table({"p": ["<s>Once", "Once", "<s>The dog"]}), tmp_path / "in.parquet")
    caplog.clear()  # the calls above logged it for the fixture's tokenizer; the job loads its own
    with caplog.at_level(logging.INFO, logger="cbrun"):
        run_job(
            manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", ["sampling.max_new_tokens=3"]),
            progress=False,
        )
    rows = rows_of(tmp_path / "out")
    assert rows[0]["num_prompt_tokens"] == rows[1]["num_prompt_tokens"] == len(tokenizer.encode("Once"))
    assert rows[0]["completion_token_ids"] == rows[1]["completion_token_ids"]
    assert caplog.text.count("already begin with the BOS token") == 1


def test_generation_config_defaults_apply_where_the_job_is_silent(model_copy, tmp_path, caplog):
    config = json.loads((model_copy / "generation_config.json").read_text())
    config.update(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.1, max_new_tokens=3)
    (model_copy / "generation_config.json").write_text(json.dumps(config))
    pq.write_table(pa.table({"p": ["a", "b"]}), tmp_path / "in.parquet")
    m = manifest(model_copy, tmp_path / "in.parquet", tmp_path / "out", ["sampling.top_k=2"])
    assert m.sampling_set == {"top_k"}
    with caplog.at_level(logging.INFO, logger="cbrun"):
        sampling, taken = model_sampling_defaults(m)
    assert taken == {"max_new_tokens": 3, "repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.9}
    assert (
        sampling.temperature,
        sampling.top_k,
        sampling.top_p,
        sampling.max_new_tokens,
        sampling.repetition_penalty,
    ) == (0.7, 2, 0.9, 3, 1.1)  # top_k: the job's own
    assert m.sampling.temperature == 0.0 and m.sampling.top_k == 2  # the manifest itself is not changed
    assert "sampling defaults from" in caplog.text and "temperature = 0.7" in caplog.text

    off = manifest(model_copy, tmp_path / "in.parquet", tmp_path / "off", ["sampling.model_defaults=false"])
    assert model_sampling_defaults(off) == (off.sampling, {})
    assert off.sampling.temperature == 0.0 and off.sampling.max_new_tokens == 128

    config["do_sample"] = False  # the model is meant to be decoded greedily: sampling keys are not taken
    (model_copy / "generation_config.json").write_text(json.dumps(config))
    greedy = manifest(model_copy, tmp_path / "in.parquet", tmp_path / "greedy")
    assert model_sampling_defaults(greedy)[1] == {"max_new_tokens": 3, "repetition_penalty": 1.1}

    # the job runs with them, and job.json records the values used
    del config["do_sample"]
    (model_copy / "generation_config.json").write_text(json.dumps(config))
    job = manifest(model_copy, tmp_path / "in.parquet", tmp_path / "run")
    given = copy.deepcopy(job)
    summary = run_job(job, progress=False)
    assert summary.num_errors == 0
    assert job == given and job.sampling.temperature == 0.0  # the run took the defaults on its own resolved copy
    assert all(r["num_completion_tokens"] <= 3 for r in rows_of(tmp_path / "run"))
    recorded = json.loads((tmp_path / "run" / "_cbrun" / "job.json").read_text())
    assert (recorded["sampling"]["temperature"], recorded["sampling"]["max_new_tokens"]) == (0.7, 3)

    config["temperature"] = -1
    (model_copy / "generation_config.json").write_text(json.dumps(config))
    with pytest.raises(JobError, match="generation_config.json.*temperature must be"):
        run_job(manifest(model_copy, tmp_path / "in.parquet", tmp_path / "bad"), progress=False)


def test_stop_token_text_is_not_in_the_completion(tiny_model_dir, tokenizer, tmp_path):
    pq.write_table(pa.table({"p": ["Once upon a time"]}), tmp_path / "in.parquet")
    run_job(
        manifest(
            tiny_model_dir,
            tmp_path / "in.parquet",
            tmp_path / "base",
            ["sampling.max_new_tokens=12", "sampling.ignore_eos=true"],
        ),
        progress=False,
    )
    base = rows_of(tmp_path / "base")[0]["completion_token_ids"]
    k = next(i for i in range(1, len(base)) if base[i] not in base[:i] and tokenizer.decode([base[i]]).strip())
    for include, out in ((False, "cut"), (True, "kept")):
        run_job(
            manifest(
                tiny_model_dir,
                tmp_path / "in.parquet",
                tmp_path / out,
                [
                    "sampling.max_new_tokens=12",
                    f"sampling.stop_token_ids=[{base[k]}]",
                    f"sampling.include_stop_str_in_output={str(include).lower()}",
                ],
            ),
            progress=False,
        )
        row = rows_of(tmp_path / out)[0]
        assert (row["completion_token_ids"], row["finish_reason"], row["stop_reason"]) == (
            base[: k + 1],
            "stop",
            str(base[k]),
        )
        assert row["completion"] == tokenizer.decode(base[: k + 1 if include else k], skip_special_tokens=True)


def test_zero_new_tokens_with_prompt_logprobs_returns_the_prompts(tiny_model_dir, tokenizer, tmp_path):
    pq.write_table(pa.table({"p": ["Once upon a time", "The dog"]}), tmp_path / "in.parquet")
    run_job(
        manifest(
            tiny_model_dir,
            tmp_path / "in.parquet",
            tmp_path / "echo",
            ["sampling.max_tokens=0", "sampling.prompt_logprobs=true"],
        ),
        progress=False,
    )
    run_job(
        manifest(
            tiny_model_dir,
            tmp_path / "in.parquet",
            tmp_path / "one",
            ["sampling.max_tokens=1", "sampling.prompt_logprobs=true"],
        ),
        progress=False,
    )
    for echo, one in zip(rows_of(tmp_path / "echo"), rows_of(tmp_path / "one")):
        assert (echo["completion"], echo["completion_token_ids"], echo["finish_reason"]) == ("", [], "length")
        assert len(echo["prompt_logprobs"]) == echo["num_prompt_tokens"] - 1 > 0
        assert echo["prompt_logprobs"] == pytest.approx(one["prompt_logprobs"], abs=1e-5)
        assert echo["prompt_greedy"] == one["prompt_greedy"]
