"""Sampling settings: edge values, batch invariance, penalties, stop strings, logprobs and prompt scoring."""

import random

import pytest
import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.core.stop_strings import StopStringMatcher
from tests.model_utils import _hf_model, assert_pool_balanced, hf_greedy, random_llama_dir, random_prompts

VOCAB = 128


def engine(**overrides) -> LLMEngine:
    config = dict(page_size=4, num_blocks=512, max_batch_tokens=64)
    config.update(overrides)
    return LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), EngineConfig(**config))


def run(requests, **overrides) -> dict:
    eng = engine(**overrides)
    outputs = {o.request_id: o for o in eng.generate(requests)}
    assert_pool_balanced(eng)
    return outputs


PROMPTS = random_prompts(32, VOCAB, 1, 30, seed=21)


def test_greedy_equivalents():
    base = run([(i, p, SamplingParams(max_new_tokens=8)) for i, p in enumerate(PROMPTS[:6])])
    for params in (
        SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1, seed=3),
        SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1e-9, seed=3),
    ):
        out = run([(i, p, params) for i, p in enumerate(PROMPTS[:6])])
        assert [out[i].output_token_ids for i in range(6)] == [base[i].output_token_ids for i in range(6)]


def test_max_new_tokens_zero_and_one():
    out = run(
        [("zero", PROMPTS[0], SamplingParams(max_new_tokens=0)), ("one", PROMPTS[0], SamplingParams(max_new_tokens=1))]
    )
    assert out["zero"].output_token_ids == [] and out["zero"].finish_reason == "length"
    assert len(out["one"].output_token_ids) == 1 and out["one"].finish_reason == "length"


@pytest.mark.parametrize(
    "setting,value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -2),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("max_new_tokens", -1),
        ("logprobs", -1),
    ],
)
def test_invalid_value_is_a_request_error_naming_the_setting(setting, value):
    out = run(
        [
            ("bad", PROMPTS[0], SamplingParams(**{setting: value})),
            ("good", PROMPTS[1], SamplingParams(max_new_tokens=2)),
        ]
    )
    assert out["bad"].finish_reason == "error" and setting in out["bad"].error
    assert out["good"].finish_reason == "length"


def seeded(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, min_p=0.01, seed=100 + i)


def neighbour(i: int) -> SamplingParams:
    kinds = [
        SamplingParams(max_new_tokens=12),
        SamplingParams(max_new_tokens=5, temperature=0.7),  # unseeded
        SamplingParams(max_new_tokens=9, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    ]
    return kinds[i % 3]


def test_seeded_sampling_is_batch_invariant():
    rows = list(range(8))
    alone = {i: run([(i, PROMPTS[i], seeded(i))])[i].output_token_ids for i in rows}
    rng = random.Random(0)
    for batch_size in (4, 32):
        requests = [(i, PROMPTS[i], seeded(i)) for i in rows]
        requests += [(f"n{j}", PROMPTS[j % 32], neighbour(j)) for j in range(batch_size - len(rows))]
        rng.shuffle(requests)
        out = run(requests, max_batch_tokens=13)
        assert {i: out[i].output_token_ids for i in rows} == alone
    # Across forced offloads (a tight cache), with and without CPU swap.
    for swap in (0.0, 0.01):
        requests = [(i, PROMPTS[i], seeded(i)) for i in rows] + [
            (f"n{j}", PROMPTS[j], neighbour(j)) for j in range(8, 24)
        ]
        out = run(requests, num_blocks=24, max_batch_tokens=16, cpu_offload_space=swap, allow_block_sharing=False)
        assert {i: out[i].output_token_ids for i in rows} == alone


def test_penalties_touch_only_their_own_row():
    greedy = [(i, PROMPTS[i], SamplingParams(max_new_tokens=12)) for i in range(6)]
    penal = ("p", PROMPTS[7], SamplingParams(max_new_tokens=12, repetition_penalty=2.0, frequency_penalty=1.0))
    without = run(greedy)
    with_penalised = run(greedy + [penal])
    assert all(with_penalised[i].output_token_ids == without[i].output_token_ids for i in range(6))
    assert with_penalised["p"].output_token_ids == run([penal])["p"].output_token_ids


def test_repetition_penalty_matches_transformers():
    model = _hf_model(random_llama_dir(VOCAB))
    for i in range(4):
        prompt = PROMPTS[i]
        want = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=10,
            min_new_tokens=10,
            repetition_penalty=1.5,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        got = run([(0, prompt, SamplingParams(max_new_tokens=10, repetition_penalty=1.5))])[0].output_token_ids
        assert got == want


def test_min_new_tokens_masks_stop_tokens():
    first = hf_greedy(random_llama_dir(VOCAB), PROMPTS[0], 1)[0]
    out = run(
        [
            ("stop", PROMPTS[0], SamplingParams(max_new_tokens=6, stop_token_ids=(first,))),
            ("min", PROMPTS[0], SamplingParams(max_new_tokens=6, stop_token_ids=(first,), min_new_tokens=3)),
        ]
    )
    assert out["stop"].output_token_ids == [first] and out["stop"].finish_reason == "stop"
    assert len(out["min"].output_token_ids) >= 3 and out["min"].output_token_ids[0] != first


def test_logprobs_are_normalised_and_include_the_chosen_token():
    out = run([(0, PROMPTS[0], SamplingParams(max_new_tokens=5, logprobs=3))])[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.output_token_ids, out.logprobs):
        assert token in lp and max(lp.values()) == lp[token]  # greedy: the chosen token is the most likely
        assert 3 <= len(lp) <= 4 and all(v <= 0 for v in lp.values())


@pytest.mark.parametrize("page_size,max_batch_tokens", [(4, 64), (4, 5)])
def test_prompt_logprobs_equal_a_direct_forward_pass(page_size, max_batch_tokens):
    model = _hf_model(random_llama_dir(VOCAB))
    context = PROMPTS[3] + PROMPTS[4]
    candidates = [PROMPTS[5][:4], PROMPTS[6][:7], hf_greedy(random_llama_dir(VOCAB), context, 3)]
    requests = [
        (j, context + c, SamplingParams(max_new_tokens=1, prompt_logprobs_from=len(context)))
        for j, c in enumerate(candidates)
    ]
    out = run(requests, page_size=page_size, max_batch_tokens=max_batch_tokens)
    for j, cand in enumerate(candidates):
        ids = torch.tensor([context + cand])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        want = [float(logprobs[len(context) - 1 + k, t]) for k, t in enumerate(cand)]
        assert out[j].prompt_logprobs == pytest.approx(want, abs=1e-4)
        greedy = [int(logprobs[len(context) - 1 + k].argmax()) == t for k, t in enumerate(cand)]
        assert out[j].prompt_greedy == greedy
    assert all(out[2].prompt_greedy)  # the greedy continuation is recognised as such


def test_stop_strings_cut_exactly(stories260k_dir):
    eng = LLMEngine.from_pretrained(str(stories260k_dir), EngineConfig(page_size=16))
    tok = eng.tokenizer
    prompt = tok("Once upon a time")["input_ids"]
    full = list(eng.generate([(0, prompt, SamplingParams(max_new_tokens=60))]))[0]
    text = tok.decode(full.output_token_ids, skip_special_tokens=True)
    stop = text[25:31]  # six characters somewhere inside the story, spanning tokens
    out = list(eng.generate([(0, prompt, SamplingParams(max_new_tokens=60, stop=(stop,)))]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert text.startswith(tok.decode(out.output_token_ids, skip_special_tokens=True))
    assert out.text.startswith(tok.decode(out.output_token_ids, skip_special_tokens=True))


def test_stop_string_matcher_with_multibyte_characters(stories260k_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories260k_dir)
    matcher = StopStringMatcher(tok)
    ids = tok("Le café 😀 est chaud", add_special_tokens=False)["input_ids"]
    # Checked after every token, as the engine does: found at the token that completes the emoji's 4 bytes.
    first = next(n for n in range(1, len(ids) + 1) if matcher.find(ids[:n], ("😀",)))
    assert tok.decode(ids[:first]).endswith("😀") and not tok.decode(ids[: first - 1]).endswith("😀")
    text, kept, stop = matcher.cut(ids, ("é 😀",))
    assert text == "Le caf" and stop == "é 😀"
    assert tok.decode(kept) == "Le caf"
    assert matcher.find(ids[:-3], ("chaud",)) is None
