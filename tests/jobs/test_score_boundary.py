"""Issue 14 §4: score mode's "exact" boundary rule (the scored tokens decode to exactly context + candidate even
when a token of the joined text straddles the cut), null generation columns, and the scoring summary line."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from cbrun.engine.config import EngineConfig
from cbrun.jobs.config.manifest import JobManifest
from cbrun.jobs.config.settings import InputSettings, ModelSettings, OutputSettings
from cbrun.jobs.modes.scoring import encode_pair
from cbrun.jobs.output.output_dir import read_output
from cbrun.jobs.run.job import run_job
from tests.model_utils import _hf_model, random_llama_dir

MERGES = [("d", "o"), ("do", "g"), ("dog", "s"), ("3", "0")]


def merging_tokenizer():
    """A byte-level BPE tokenizer (GPT-2 style) whose merges make "dogs" and "30" single tokens, so "The dog" +
    "s ran" and "3" + "0" straddle the context / candidate cut."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    for special in ("<s>", "</s>"):
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = merging_tokenizer()
    path = shutil.copytree(random_llama_dir(len(tok)), tmp_path_factory.mktemp("merging") / "model")
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "context, candidate, scored",
    [("The dog", "s ran", "s ran"), ("3", "0", "0"), ("The dog ", "s", " s"), ("The cat", " sat", " sat")],
)
def test_scored_tokens_decode_to_exactly_context_plus_candidate(context, candidate, scored):
    tok = merging_tokenizer()
    context_ids, ids = encode_pair(tok, context, candidate)
    assert context_ids == tok.encode(context.rstrip())
    assert tok.decode(ids) == scored  # trailing context whitespace moves to the candidate's front
    assert tok.decode(context_ids + ids, skip_special_tokens=True) == context + candidate


def test_the_fault_the_rule_fixes():
    tok = merging_tokenizer()
    context_ids, whole = tok.encode("The dog"), tok.encode("The dogs ran")
    assert whole[: len(context_ids)] != context_ids  # " dogs" straddles the cut
    assert tok.decode(whole[len(context_ids) :]) == " ran"  # cutting the joined ids at the context's length drops "s"


def test_score_rows_are_exact_and_have_null_generation_columns(model_dir, tmp_path):
    pq.write_table(
        pa.table({"context": ["The dog", "3"], "candidates": [["s ran", " sat"], ["0", "1"]]}), tmp_path / "in.parquet"
    )
    manifest = JobManifest(
        model=ModelSettings(path=str(model_dir)),
        input=InputSettings(
            path=str(tmp_path / "in.parquet"),
            prompt_column="context",
            mode="score",
            candidates_column="candidates",
            boundary="exact",
        ),
        engine=EngineConfig(page_size=4, num_blocks=128, max_batch_tokens=64),
        output=OutputSettings(path=str(tmp_path / "out")),
    )
    summary = run_job(manifest, progress=False)
    rows = read_output(tmp_path / "out").sort_by("row_index").to_pylist()
    tok = merging_tokenizer()
    model = _hf_model(random_llama_dir(len(tok)))
    for row, context, candidates in zip(rows, ["The dog", "3"], [["s ran", " sat"], ["0", "1"]]):
        assert (
            row["completion"],
            row["completion_token_ids"],
            row["num_completion_tokens"],
            row["finish_reason"],
            row["error"],
        ) == (None, None, None, None, None)
        want_logprobs, want_tokens = [], []
        for candidate in candidates:
            context_ids, ids = encode_pair(tok, context, candidate)
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([context_ids + ids])).logits[0].float(), dim=-1)
            rows_ = logprobs[len(context_ids) - 1 : -1]
            want_logprobs.append(float(rows_.gather(1, torch.tensor(ids)[:, None]).sum()))
            want_tokens.append(len(ids))
        assert row["candidate_logprobs"] == pytest.approx(want_logprobs, abs=1e-4)
        assert row["candidate_num_tokens"] == want_tokens
    assert rows[0]["candidate_num_tokens"][0] == len("s ran")  # byte tokens of "s ran" (no merge applies)
    assert (summary.num_candidates, summary.num_scored_tokens) == (4, len("s ran") + len(" sat") + 2)
    line = summary.line()
    assert "2 rows (0 errors, 0 skipped) | 4 candidates |" in line and "candidates/s" in line
    assert "tokens/s scored" in line and "generated" not in line
    with pytest.raises(ValueError, match="input.boundary must be one of 'exact'"):
        InputSettings(path="x", prompt_column="c", mode="score", candidates_column="k", boundary="hf")
