"""Issue 14 §3 (engine): a stop token's text is not in the output text (unless include_stop_str_in_output, which
also keeps a stop string), max_new_tokens = 0 with prompt log-probabilities scores the prompt, and logprobs are
raw (vLLM's default) or processed (``logprobs_mode``)."""

from __future__ import annotations

import pytest
import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from tests.model_utils import _hf_model, random_llama_dir, random_prompts

VOCAB = 128
PROMPT = random_prompts(1, VOCAB, 12, 12, seed=5)[0]


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    return LLMEngine.from_pretrained(
        str(tiny_model_dir), EngineConfig(page_size=16, num_blocks=64, max_batch_tokens=256)
    )


@pytest.fixture(scope="module")
def random_engine():
    return LLMEngine.from_pretrained(
        str(random_llama_dir(VOCAB)), EngineConfig(page_size=4, num_blocks=256, max_batch_tokens=64)
    )


def one(engine, prompt, params):
    return list(engine.generate([(0, prompt, params)]))[0]


def hf_logprobs(ids: list[int]) -> torch.Tensor:
    """(len(ids), V) log-softmax of transformers' logits for ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(_hf_model(random_llama_dir(VOCAB))(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_a_stop_tokens_text_is_cut_like_a_stop_string(tiny_engine):
    tok = tiny_engine.tokenizer
    prompt = tok.encode("Once upon a time")
    base = one(tiny_engine, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)).output_token_ids
    k = next(i for i in range(1, len(base)) if base[i] not in base[:i] and tok.decode([base[i]]).strip())
    stop = base[k]
    out = one(tiny_engine, prompt, SamplingParams(max_new_tokens=12, stop_token_ids=[stop]))
    assert (out.output_token_ids, out.finish_reason, out.stop_reason) == (base[: k + 1], "stop", stop)
    assert out.text == tok.decode(base[:k], skip_special_tokens=True)  # the id stays, its text does not
    assert out.text != tok.decode(base[: k + 1], skip_special_tokens=True)
    kept = one(
        tiny_engine, prompt, SamplingParams(max_new_tokens=12, stop_token_ids=[stop], include_stop_str_in_output=True)
    )
    assert kept.output_token_ids == base[: k + 1] and kept.text is None  # None: the text is all the ids decoded


def test_include_stop_str_in_output_keeps_the_stop_string(tiny_engine):
    tok = tiny_engine.tokenizer
    prompt = tok.encode("Once upon a time")
    base = one(tiny_engine, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)).output_token_ids
    text = tok.decode(base, skip_special_tokens=True)
    index = next(i for i in range(1, len(text)) if text[i].isalnum() and text[i] not in text[:i])
    stop = text[index]
    cut = one(tiny_engine, prompt, SamplingParams(max_new_tokens=12, stop=[stop], ignore_eos=True))
    assert (cut.text, cut.stop_reason) == (text[:index], stop)
    kept = one(
        tiny_engine,
        prompt,
        SamplingParams(max_new_tokens=12, stop=[stop], ignore_eos=True, include_stop_str_in_output=True),
    )
    assert (kept.text, kept.stop_reason, kept.finish_reason) == (text[: index + 1], stop, "stop")
    ids = kept.output_token_ids  # ends with the token that completes the stop string
    assert ids == base[: len(ids)] and tok.decode(ids).startswith(text[: index + 1])
    assert not tok.decode(ids[:-1]).startswith(text[: index + 1])


def test_zero_new_tokens_with_prompt_logprobs_scores_the_prompt(random_engine):
    generated_before = random_engine.stats.num_generated_tokens
    out = one(random_engine, PROMPT, SamplingParams(max_new_tokens=0, prompt_logprobs_from=1))
    assert random_engine.stats.num_generated_tokens == generated_before  # the token after the prompt is dropped
    assert (out.output_token_ids, out.finish_reason, out.stop_reason, out.text) == ([], "length", None, None)
    want = hf_logprobs(PROMPT)
    assert out.prompt_logprobs == pytest.approx(
        [float(want[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))], abs=1e-4
    )
    assert out.prompt_greedy == [int(want[i - 1].argmax()) == PROMPT[i] for i in range(1, len(PROMPT))]
    plain = one(random_engine, PROMPT, SamplingParams(max_new_tokens=0))  # no forward pass, nothing returned
    assert (plain.output_token_ids, plain.prompt_logprobs) == ([], None)


def test_logprobs_are_raw_by_default_and_processed_on_request(random_engine):
    params = dict(max_new_tokens=6, temperature=0.7, top_k=5, repetition_penalty=1.5, logprobs=3, seed=11)
    raw = one(random_engine, PROMPT, SamplingParams(**params))
    processed = one(random_engine, PROMPT, SamplingParams(**params, logprobs_mode="processed_logprobs"))
    assert processed.output_token_ids == raw.output_token_ids  # the mode changes what is reported, not sampling
    ids = PROMPT + raw.output_token_ids
    model = hf_logprobs(ids)
    for step, (token, got_raw, got_processed) in enumerate(zip(raw.output_token_ids, raw.logprobs, processed.logprobs)):
        row = model[len(PROMPT) - 1 + step]
        assert got_raw[token] == pytest.approx(float(row[token]), abs=1e-4)
        top = torch.topk(row, 3).indices.tolist()
        assert set(got_raw) == set(top) | {token}
        # processed: repetition penalty over the tokens seen so far, temperature, top-k; then log-softmax
        with torch.no_grad():  # the penalty scales logits, not log-probabilities: start from the logits
            logits = _hf_model(random_llama_dir(VOCAB))(torch.tensor([ids[: len(PROMPT) + step]])).logits[0, -1]
        logits = logits.float().clone()
        seen = torch.tensor(sorted(set(ids[: len(PROMPT) + step])))
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / 1.5, values * 1.5)
        logits = logits / 0.7
        kth = torch.topk(logits, 5).values[-1]
        want = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        assert got_processed[token] == pytest.approx(float(want[token]), abs=1e-4)
        assert sum(torch.tensor(list(got_processed.values())).exp()) <= 1.0 + 1e-5
        assert all(torch.isfinite(want[t]) for t in got_processed)  # only top-k survivors are reported
