"""Score mode: candidate log-probabilities equal a direct transformers forward pass (tiny model and stories260K),
corruptions, row errors, prefix sharing of the context, resume, and the shipped GSM8K scoring manifest."""

from __future__ import annotations

import functools
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from cbrun.engine.config import EngineConfig
from cbrun.jobs.config.manifest import JobManifest, load_manifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from cbrun.jobs.modes.scoring import encode_pair, last_number_plus_one, read_candidates
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import JobError, run_job

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_CONFIG = EngineConfig(page_size=8, max_batch_tokens=128, max_requests_per_batch=8, num_blocks=128)


@functools.lru_cache(maxsize=None)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def oracle(model_dir, tokenizer, context: str, continuation: str) -> tuple[float, int, bool]:
    """(summed log-probability, number of tokens, is greedy) of the continuation from one forward pass."""
    context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(str(model_dir))(ids).logits[0].float(), dim=-1)
    rows = logprobs[len(context_ids) - 1 : -1]  # the positions that predict the continuation tokens
    targets = torch.tensor(continuation_ids)
    total = float(rows.gather(1, targets[:, None]).sum())
    return total, len(continuation_ids), bool((rows.argmax(dim=-1) == targets).all())


def score_manifest(model_dir, input_path, output_dir, **input_settings) -> JobManifest:
    input_settings = {
        "prompt_column": "context",
        "id_column": "id",
        "mode": "score",
        "candidates_column": "candidates",
        **input_settings,
    }
    return JobManifest(
        model=ModelSettings(path=str(model_dir)),
        input=InputSettings(path=str(input_path), **input_settings),
        engine=ENGINE_CONFIG,
        output=OutputSettings(path=str(output_dir), commit_every_rows=2),
    )


def by_index(output_dir) -> dict[int, dict]:
    rows = read_output(output_dir).to_pylist()
    out = {row["row_index"]: row for row in rows}
    assert len(out) == len(rows), "one output row per input row"
    return out


def test_last_number_plus_one():
    assert last_number_plus_one("She makes $18 every day.\n#### 18") == "She makes $18 every day.\n#### 19"
    assert last_number_plus_one("#### 1,999") == "#### 2,000"
    assert last_number_plus_one("#### -1") == "#### 0"
    assert last_number_plus_one("costs 2.50 each") == "costs 3.50 each"
    with pytest.raises(ValueError, match="no number"):
        last_number_plus_one("no digits here")


def test_read_candidates():
    assert read_candidates("a 1", ["last_number_plus_one"]) == ["a 1", "a 2"]
    assert read_candidates(["x", "y"], []) == ["x", "y"]
    for value, message in (
        (None, "null"),
        ([], "no candidates"),
        (["x", None], "candidate 1 is null"),
        ([""], "candidate 0 is empty"),
    ):
        with pytest.raises(ValueError, match=message):
            read_candidates(value, [])
    with pytest.raises(ValueError, match="corruption 'last_number_plus_one' cannot apply"):
        read_candidates("none", ["last_number_plus_one"])


def test_encode_pair_moves_trailing_whitespace_into_the_continuation(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    context_ids, continuation_ids = encode_pair(tok, "Answer: ", "18")
    assert context_ids == tok.encode("Answer:")
    assert tok.decode(continuation_ids) == " 18"


def test_scores_equal_a_direct_forward_pass_on_the_tiny_model(tiny_model_dir, tiny_engine, tmp_path):
    tok = tiny_engine.tokenizer
    contexts = ["The quick brown fox jumps over the lazy dog and then", "Answer: ", "Q: 2+2?\nA:"]
    candidates = [[" runs away", " sleeps", "!"], ["18", "19 apples"], [" 4 #### 4"]]
    # a greedy continuation of the first context, as text that round-trips through the byte tokenizer
    context_ids = tok.encode(contexts[0])
    greedy = list(tiny_engine.generate([(0, context_ids, tiny_engine_params(3))]))[0].output_token_ids
    greedy_text = tok.decode(greedy)
    assert tok.encode(contexts[0] + greedy_text)[len(context_ids) :] == greedy, "pick another context"
    candidates[0].append(greedy_text)
    table = pa.table(
        {"id": ["a", "b", "c"], "context": contexts, "candidates": pa.array(candidates, pa.list_(pa.string()))}
    )
    pq.write_table(table, tmp_path / "in.parquet")
    manifest = score_manifest(
        tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", corruptions=["last_number_plus_one"]
    )
    cached_before = tiny_engine.stats.num_cached_prompt_tokens
    summary = run_job(manifest, progress=False, engine=tiny_engine)
    # row 0 (4 candidates, no number) cannot take the corruption: a row error naming it
    assert (summary.num_rows, summary.num_errors) == (3, 1)
    out = by_index(tmp_path / "out")
    assert out[0]["error"].startswith("row 0 (id 'a'): corruption 'last_number_plus_one' cannot apply")

    manifest = score_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "plain")
    run_job(manifest, progress=False, engine=tiny_engine)
    plain = by_index(tmp_path / "plain")
    scored = {
        0: (plain[0], candidates[0]),
        1: (out[1], ["18", "19 apples", "19"]),
        2: (out[2], [" 4 #### 4", " 4 #### 5"]),
    }
    for i, (row, cands) in scored.items():
        want = [oracle(tiny_model_dir, tok, contexts[i], c) for c in cands]
        assert row["candidate_logprobs"] == pytest.approx([w[0] for w in want], abs=1e-3)
        assert row["candidate_num_tokens"] == [w[1] for w in want]
        assert row["candidate_is_greedy"] == [w[2] for w in want]
        assert (row["finish_reason"], row["completion"], row["num_completion_tokens"]) == (None, None, None)
        assert row["num_prompt_tokens"] == len(encode_pair(tok, contexts[i], "x")[0])
    assert plain[0]["candidate_is_greedy"][-1] is True
    # the context's full blocks are computed once per row and shared by its candidates
    assert tiny_engine.stats.num_cached_prompt_tokens - cached_before >= 2 * 3 * ENGINE_CONFIG.page_size


def tiny_engine_params(n: int):
    from cbrun.engine.sampling_params import SamplingParams

    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def test_bad_rows_and_resume(tiny_model_dir, tiny_engine, tmp_path):
    contexts = ["one", "two", None, "four", "five " * 60, "six", "seven"]
    candidates = [["a"], [" b", " c"], ["x"], None, ["y"], [], ["z 1"]]
    table = pa.table(
        {
            "id": [f"r{i}" for i in range(7)],
            "context": contexts,
            "candidates": pa.array(candidates, pa.list_(pa.string())),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=3)
    full = score_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "full")
    run_job(full, progress=False, engine=tiny_engine)
    reference = by_index(tmp_path / "full")
    assert reference[2]["error"] == "row 2 (id 'r2'): prompt column 'context' is null"
    assert reference[3]["error"] == "row 3 (id 'r3'): candidates column is null"
    assert "context + candidate have" in reference[4]["error"] and "maximum length is 256" in reference[4]["error"]
    assert reference[5]["error"] == "row 5 (id 'r5'): candidates column holds no candidates"
    assert sorted(i for i, r in reference.items() if r["error"] is None) == [0, 1, 6]

    part = score_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", limit=3)
    assert run_job(part, progress=False, engine=tiny_engine).num_rows == 3
    part.input.limit = None
    summary = run_job(part, progress=False, engine=tiny_engine)
    assert (summary.num_rows, summary.num_skipped) == (4, 3)
    out = by_index(tmp_path / "out")
    columns = ("candidate_num_tokens", "candidate_is_greedy", "error")
    assert {i: [r[c] for c in columns] for i, r in out.items()} == {
        i: [r[c] for c in columns] for i, r in reference.items()
    }
    for i in (0, 1, 6):  # batched differently, so equal up to float rounding
        assert out[i]["candidate_logprobs"] == pytest.approx(reference[i]["candidate_logprobs"], abs=1e-4)
    assert run_job(part, progress=False, engine=tiny_engine).already_finished


def test_score_settings_are_checked_before_any_work(tiny_model_dir, tmp_path):
    pq.write_table(pa.table({"id": ["a"], "context": ["a"], "candidates": [1]}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match="candidates_column 'candidates' .* must hold text"):
        run_job(score_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out"), progress=False)
    with pytest.raises(JobError, match="input.candidates_column 'answers' is not a column"):
        run_job(
            score_manifest(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", candidates_column="answers"),
            progress=False,
        )
    assert not (tmp_path / "out").exists()
    for settings, message in (
        ({"candidates_column": None}, "needs input.candidates_column"),
        ({"mode": "rank"}, "input.mode must be"),
        ({"corruptions": ["shuffle"]}, "input.corruptions must be a list of names"),
        ({"chat": True}, "needs a text context"),
    ):
        with pytest.raises(ValueError, match=message):
            score_manifest(tiny_model_dir, "in", "out", **settings)
    with pytest.raises(ValueError, match="need input.mode"):
        InputSettings(path="in", prompt_column="p", candidates_column="c")


def test_gsm8k_manifest_on_stories260k_equals_a_forward_pass(stories260k_dir, shared_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.chdir(REPO_ROOT)  # the manifest's relative paths are written for the repository root
    manifest = load_manifest(
        REPO_ROOT / "manifests" / "gsm8k-score-stories260k.toml",
        overrides={
            "model": {"path": str(stories260k_dir)},
            "input": {"limit": 3},
            "output": {"path": str(tmp_path / "out")},
        },
    )
    inp = manifest.input
    assert (inp.mode, inp.candidates_column, inp.corruptions) == ("score", "answer", ["last_number_plus_one"])
    summary = run_job(manifest, progress=False)
    assert (summary.num_rows, summary.num_errors) == (3, 0)
    tok = AutoTokenizer.from_pretrained(stories260k_dir)
    questions = pq.read_table(shared_dir / "data" / "gsm8k_test.parquet").slice(0, 3).to_pylist()
    out = by_index(tmp_path / "out")
    for i, q in enumerate(questions):
        context = inp.template.format(**q)
        cands = [q["answer"], last_number_plus_one(q["answer"])]
        assert cands[1].endswith(str(int(q["answer"].rsplit("####", 1)[1]) + 1))
        want = [oracle(stories260k_dir, tok, context, c) for c in cands]
        assert out[i]["id"] == q["id"]
        assert out[i]["candidate_logprobs"] == pytest.approx([w[0] for w in want], abs=2e-3)
        assert out[i]["candidate_num_tokens"] == [w[1] for w in want]
        assert out[i]["candidate_is_greedy"] == [w[2] for w in want]


def test_stories260k_greedy_continuation_is_recognised(stories260k_dir, tmp_path):
    from cbrun.engine import LLMEngine
    from cbrun.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_pretrained(str(stories260k_dir), EngineConfig(page_size=16, num_blocks=64))
    tok = engine.tokenizer
    context = "Once upon a time"
    greedy = list(engine.generate([(0, tok.encode(context), SamplingParams(max_new_tokens=8))]))[0]
    text = tok.decode(greedy.output_token_ids, skip_special_tokens=True)
    pq.write_table(
        pa.table({"context": [context], "candidates": [[text, " there was a dragon"]]}), tmp_path / "in.parquet"
    )
    manifest = score_manifest(stories260k_dir, tmp_path / "in.parquet", tmp_path / "out", id_column=None)
    run_job(manifest, progress=False, engine=engine)
    row = by_index(tmp_path / "out")[0]
    want = [oracle(stories260k_dir, tok, context, c) for c in (text, " there was a dragon")]
    assert row["candidate_logprobs"] == pytest.approx([w[0] for w in want], abs=1e-3)
    assert row["candidate_is_greedy"] == [w[2] for w in want] == [True, False]
