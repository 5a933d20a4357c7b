"""Speculative decoding (n-gram proposals): greedy outputs token-identical to speculation off.

Oracles: llama2.c's goldens for stories260K, transformers' ``generate`` for random Llama / Qwen2, and the engine
with speculation off (stop tokens, stop strings, max_new_tokens, the model length, tight caches, prefix sharing).
"""

from __future__ import annotations

import logging

import pytest
import transformers

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.spec_decode.speculative import NgramIndex, NgramProposer, accept_greedy
from tests.model_utils import (
    WEIGHT_SCALE,
    assert_pool_balanced,
    assert_same_outputs_and_logprobs,
    hf_greedy,
    random_llama_dir,
    random_prompts,
    session_tmp_dir,
)

VOCAB = 128


def _generate(engine: LLMEngine, requests) -> dict:
    outputs = {o.request_id: o for o in engine.generate(requests)}
    assert_pool_balanced(engine)
    return outputs


def _repetitive_prompts(n: int, seed: int = 3) -> list[list[int]]:
    """Prompts that repeat a random phrase, so n-gram lookup finds proposals (random models loop, too)."""
    phrases = random_prompts(n, VOCAB, 3, 9, seed=seed)
    return [(phrase * 5)[:30] for phrase in phrases]


# ---- the proposer and the acceptance rule ---------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(ngram_min=1, ngram_max=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # "6 7" (n=2) occurs at 1 and 5; the latest is 5, followed by 1 2 6 7; n=3 "9 6 7"... no: "2 6 7" is new.
    assert proposer.propose(tokens, 3) == [1, 2, 6]
    assert proposer.propose(tokens, 10) == [1, 2, 6, 7]  # up to the end of the sequence
    assert proposer.propose(tokens, 0) == []
    # The longest n wins over a later shorter match: "8 9" (n=2) at 3 beats "9" (n=1) at 12.
    assert NgramProposer(1, 2).propose([8, 9, 4, 4, 8, 9, 3, 9, 5, 8, 9], 2) == [3, 9]
    assert NgramProposer(2, 3).propose([1, 2, 3, 4], 2) == []  # no earlier occurrence
    assert NgramProposer(2, 3).propose([1], 2) == []


def test_ngram_index_grown_token_by_token_proposes_as_a_fresh_lookup():
    """The incremental index a running request keeps gives, at every length, what a scan of the whole sequence
    gives (latest match, longest n first); each token is indexed once."""
    import random

    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]  # a small vocabulary: many repeated n-grams
    for low, high in ((1, 3), (2, 4)):
        index = NgramIndex(low, high)
        for length in range(len(tokens)):
            index.extend(tokens[length : length + 1])
            for k in (1, 5):
                assert index.propose(k) == _scan_propose(tokens[: length + 1], low, high, k), (low, high, length)


def _scan_propose(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """Prompt lookup by a full scan: the tokens after the latest earlier match of the longest suffix n-gram."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        starts = [j for j in range(len(tokens) - n) if tokens[j : j + n] == tokens[-n:]]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


def test_accept_greedy_takes_matching_prefix_then_bonus():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, plus the bonus
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the target's token replaces the first miss
    assert accept_greedy([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept_greedy([], [3]) == [3]


# ---- refusals -----------------------------------------------------------------------------------------------
def test_config_refuses_unsupported_settings():
    with pytest.raises(ValueError, match="needs a draft model"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="medusa")
    with pytest.raises(ValueError, match="ngram_min"):
        EngineConfig(speculative="ngram", ngram_min=4, ngram_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)


def test_engine_refuses_async_batching():
    with pytest.raises(ValueError, match="async_batching"):
        LLMEngine.from_pretrained(
            str(random_llama_dir(VOCAB)), EngineConfig(speculative="ngram", async_batching="on", num_blocks=64)
        )


# ---- exactness -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [4, 16])
def test_ngram_reproduces_llama2c_goldens(stories260k_dir, reference_greedy, page_size):
    config = EngineConfig(
        page_size=page_size,
        max_batch_tokens=16,
        speculative="ngram",
        num_speculative_tokens=5,
        ngram_min=1,
        ngram_max=3,
    )
    engine = LLMEngine.from_pretrained(str(stories260k_dir), config)
    requests = [
        (
            i,
            line["prompt_token_ids"],
            SamplingParams(max_new_tokens=line["max_positions"] - len(line["prompt_token_ids"]) + 1),
        )
        for i, line in enumerate(reference_greedy)
    ]
    outputs = _generate(engine, requests)
    for i, line in enumerate(reference_greedy):
        assert outputs[i].output_token_ids == line["output_token_ids"], f"line {i}: {line['prompt']!r}"
    stats = engine.stats
    assert stats.num_verify_steps > 0 and 0 < stats.num_accepted_tokens <= stats.num_proposed_tokens
    assert stats.as_dict()["acceptance_rate"] == stats.num_accepted_tokens / stats.num_proposed_tokens
    assert 1 < stats.mean_tokens_per_verify_step <= 6


def _random_model_dir(arch: str):
    if arch == "llama":
        return random_llama_dir(VOCAB)
    import torch

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(WEIGHT_SCALE)
    path = session_tmp_dir("cbrun-qwen2-")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ngram_equals_transformers_generate(arch):
    model_dir = _random_model_dir(arch)
    prompts = _repetitive_prompts(6) + random_prompts(4, VOCAB, 1, 20, seed=7)
    config = EngineConfig(
        page_size=4,
        max_batch_tokens=16,
        num_blocks=256,
        speculative="ngram",
        num_speculative_tokens=4,
        ngram_min=1,
        ngram_max=3,
    )
    engine = LLMEngine.from_pretrained(str(model_dir), config)
    params = SamplingParams(max_new_tokens=20)
    outputs = _generate(engine, [(i, p, params) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == hf_greedy(model_dir, prompt, 20), f"prompt {i}"
    assert engine.stats.num_accepted_tokens > 0


def _off_and_ngram(model_dir, requests, **config):
    results = []
    for speculative in ("off", "ngram"):
        engine = LLMEngine.from_pretrained(str(model_dir), EngineConfig(speculative=speculative, **config))
        results.append((_generate(engine, requests), engine.stats))
    return results


@pytest.mark.parametrize(
    "config",
    [
        dict(page_size=4, max_batch_tokens=24, num_blocks=12, safety_margin=0.0),  # tight: soft resets happen
        dict(page_size=4, max_batch_tokens=32, num_blocks=256, allow_block_sharing=True),  # shared prefixes
    ],
    ids=["tight-cache", "prefix-sharing"],
)
def test_ngram_equals_off_under_pressure_and_sharing(config):
    model_dir = random_llama_dir(VOCAB)
    shared = _repetitive_prompts(1, seed=11)[0][:16]
    prompts = [shared + p[:6] for p in _repetitive_prompts(6)] + _repetitive_prompts(4, seed=5)
    requests = [(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(prompts)]
    (off, off_stats), (ngram, ngram_stats) = _off_and_ngram(
        model_dir, requests, num_speculative_tokens=4, ngram_min=1, ngram_max=3, **config
    )
    for i in range(len(prompts)):
        assert ngram[i].output_token_ids == off[i].output_token_ids, f"prompt {i}"
        assert ngram[i].finish_reason == off[i].finish_reason
    assert ngram_stats.num_accepted_tokens > 0
    if config["num_blocks"] == 12:
        assert off_stats.num_soft_resets > 0 and ngram_stats.num_soft_resets > 0
    else:
        assert ngram_stats.num_cached_prompt_tokens > 0


def test_ngram_stops_inside_an_accepted_run_where_plain_decoding_stops(stories260k_dir):
    """Stop tokens, stop strings, max_new_tokens and the model length cut an accepted run exactly."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(stories260k_dir))
    story = tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play outside.")
    prompt = story + story[1:]  # the story twice: n-gram lookup proposes its continuation
    off_engine = LLMEngine.from_pretrained(str(stories260k_dir), EngineConfig())
    plain = _generate(off_engine, [("p", prompt, SamplingParams(max_new_tokens=40))])["p"].output_token_ids
    stop_token = plain[7]
    stop_text = tokenizer.decode(plain[10:12])
    requests = [
        ("max", prompt, SamplingParams(max_new_tokens=9)),
        ("token", prompt, SamplingParams(max_new_tokens=40, stop_token_ids=(stop_token,))),
        ("string", prompt, SamplingParams(max_new_tokens=40, stop=(stop_text,))),
        ("length", story, SamplingParams(max_new_tokens=600, ignore_eos=True)),  # runs into the model length
    ]
    (off, _), (ngram, stats) = _off_and_ngram(stories260k_dir, requests, num_speculative_tokens=6, ngram_min=1)
    for name, *_ in requests:
        assert ngram[name].output_token_ids == off[name].output_token_ids, name
        assert (ngram[name].finish_reason, ngram[name].stop_reason, ngram[name].text) == (
            off[name].finish_reason,
            off[name].stop_reason,
            off[name].text,
        ), name
    assert off["token"].stop_reason == stop_token and off["string"].stop_reason == stop_text
    assert off["length"].finish_reason == "length" and len(off["length"].output_token_ids) > 40
    assert stats.num_accepted_tokens > 0


def test_switch_to_plain_decoding_above_speculative_max_batch(caplog):
    model_dir = random_llama_dir(VOCAB)
    prompts = _repetitive_prompts(8)
    requests = [(i, p, SamplingParams(max_new_tokens=8 + 4 * i)) for i, p in enumerate(prompts)]
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        (off, _), (ngram, stats) = _off_and_ngram(
            model_dir, requests, num_blocks=256, page_size=4, speculative_max_batch=3, ngram_min=1
        )
    assert all(ngram[i].output_token_ids == off[i].output_token_ids for i in range(len(prompts)))
    assert stats.num_verify_steps > 0  # the tail (3 or fewer left) speculated
    messages = [r.getMessage() for r in caplog.records if "speculative decoding" in r.getMessage()]
    # Each switch is logged once: paused when the batch filled past the limit, resumed in the tail.
    assert len(messages) == 2 and "paused" in messages[0] and "resumed" in messages[1]


def test_host_processed_greedy_rows_equal_off():
    """Penalties, min_new_tokens and log-probabilities see the accepted tokens before each verified position."""
    model_dir = random_llama_dir(VOCAB)
    prompts = _repetitive_prompts(6)
    params = [
        SamplingParams(max_new_tokens=16, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=16, presence_penalty=0.5, frequency_penalty=0.3, logprobs=2),
        SamplingParams(
            max_new_tokens=16,
            min_new_tokens=5,
            stop_token_ids=(3, 7, 11),
            logprobs=0,
            logprobs_mode="processed_logprobs",
        ),
    ]
    requests = [(i, p, params[i % 3]) for i, p in enumerate(prompts)]
    (off, _), (ngram, stats) = _off_and_ngram(model_dir, requests, num_blocks=256, page_size=4, ngram_min=1)
    assert_same_outputs_and_logprobs(ngram, off)
    assert stats.num_accepted_tokens > 0


def test_seeded_sampled_rows_are_reproducible_and_independent_of_batch():
    model_dir = random_llama_dir(VOCAB)
    prompts = _repetitive_prompts(6)
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, seed=1234)
    config = EngineConfig(speculative="ngram", ngram_min=1, num_blocks=256, page_size=4)
    alone = _generate(LLMEngine.from_pretrained(str(model_dir), config), [("x", prompts[0], params)])["x"]
    others = [(i, p, SamplingParams(max_new_tokens=12, temperature=1.0, seed=i)) for i, p in enumerate(prompts)]
    engine = LLMEngine.from_pretrained(str(model_dir), config)
    crowded = _generate(engine, others[:3] + [("x", prompts[0], params)] + others[3:])["x"]
    assert crowded.output_token_ids == alone.output_token_ids
    assert engine.stats.num_verify_steps > 0


def _markov_model_dir(transitions, path) -> str:
    """A Llama whose next-token distribution is ``transitions[last token]`` exactly: every block's output
    projections are zero (the residual stream is the last token's embedding), embeddings are scaled one-hot rows,
    so the final RMSNorm gives ``sqrt(hidden) * onehot``, and the LM head holds ``log(transitions)``."""
    import torch

    vocab, hidden = transitions.shape[0], 64
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :vocab] = torch.log(transitions).T / hidden**0.5
    model.save_pretrained(path)
    return str(path)


def _chi_square_p(observed, expected_probs) -> float:
    """Pearson's chi-square p-value, cells with an expected count under 5 pooled into one."""
    import numpy as np
    from scipy.stats import chisquare

    expected = np.asarray(expected_probs) * sum(observed)
    small = expected < 5
    obs = np.append(np.asarray(observed)[~small], np.asarray(observed)[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.slow
def test_sampling_with_speculation_keeps_the_target_distribution(tmp_path):
    """Rejection sampling with point-mass (n-gram) proposals: the verified tokens' frequencies over many seeded
    draws match a toy model's known distribution (chi-square, fixed seeds, so the test is deterministic)."""
    import numpy as np
    import torch

    vocab, num_draws = 8, 1500
    # Next token: the successor (a + 1) with probability 0.6, any other with 0.4 / 7.
    transitions = torch.full((vocab, vocab), 0.4 / (vocab - 1), dtype=torch.float64)
    transitions[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] = 0.6
    model_dir = _markov_model_dir(transitions.float(), tmp_path / "markov")
    prompt = list(range(vocab)) * 2  # n-gram lookup proposes each token's successor
    config = EngineConfig(
        speculative="ngram",
        ngram_min=1,
        ngram_max=2,
        num_speculative_tokens=2,
        num_blocks=512,
        page_size=4,
        max_batch_tokens=512,
        max_requests_per_batch=128,
        speculative_max_batch=128,
    )
    engine = LLMEngine.from_pretrained(model_dir, config)
    requests = [(i, prompt, SamplingParams(max_new_tokens=3, temperature=1.0, seed=i)) for i in range(num_draws)]
    outputs = _generate(engine, requests)
    tokens = np.array([outputs[i].output_token_ids for i in range(num_draws)])
    stats = engine.stats
    assert stats.num_verify_steps == stats.num_proposed_tokens == num_draws  # t2 verified, t3 the bonus
    assert 0.5 < stats.acceptance_rate < 0.7  # p(successor) = 0.6: both branches of the rule ran often
    t = transitions.numpy()
    exact12 = (t[prompt[-1]][:, None] * t).reshape(-1)  # p(t1, t2), t1 major
    exact3 = exact12 @ np.tile(t, (vocab, 1))  # sum over (t1, t2) of p(t1, t2) * p(t3 | t2)
    # t2 is the verified token: its joint with t1 (which fixes the proposal) shows a wrong accept/resample rule.
    observed12 = np.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
    assert _chi_square_p(observed12, exact12) > 1e-3, (observed12, exact12 * num_draws)
    observed3 = np.bincount(tokens[:, 2], minlength=vocab)
    assert _chi_square_p(observed3, exact3) > 1e-3, (observed3, exact3 * num_draws)


# ---- scheduling and rollback, without a model -------------------------------------------------------------------
def test_a_verify_steps_tokens_are_read_before_the_request_runs_again():
    """With a verify step in flight, how many tokens it commits is unknown: the request is not planned again (its
    next input cannot be taken from the device) until the step is read."""
    from cbrun.engine.core.block_manager import BlockManager
    from cbrun.engine.core.cache_spec import CacheSpec
    from cbrun.engine.core.plan import StepOutput
    from cbrun.engine.core.request import Request
    from cbrun.engine.core.scheduler import FIFOScheduler

    config = EngineConfig(
        page_size=4, num_blocks=64, max_batch_tokens=32, speculative="ngram", ngram_min=1, num_speculative_tokens=6
    )
    scheduler = FIFOScheduler(config, BlockManager(CacheSpec.build(config.num_blocks, config.page_size), True))
    request = Request("r", [5, 6, 7, 8, 9, 10, 11, 12, 5, 6], SamplingParams(max_new_tokens=50))
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.advance(out)
    scheduler.update_from_output(out, StepOutput({request.index: [7]}))
    verify = scheduler.schedule()
    assert verify.scheduled[0].spec_token_ids
    scheduler.advance(verify)  # launched; async batching plans the next step before reading it
    assert request.num_pending_tokens == 1 and not scheduler.schedule().scheduled
    scheduler.update_from_output(verify, StepOutput({request.index: [8, 9, 3]}))
    assert [s.request_id for s in scheduler.schedule().scheduled] == ["r"]


def test_verify_step_rolls_back_rejected_slots_and_never_caches_them():
    from cbrun.engine.core.block_manager import BlockManager
    from cbrun.engine.core.cache_spec import CacheSpec
    from cbrun.engine.core.plan import StepOutput
    from cbrun.engine.core.request import Request
    from cbrun.engine.core.scheduler import FIFOScheduler

    config = EngineConfig(
        page_size=4, num_blocks=64, max_batch_tokens=32, speculative="ngram", ngram_min=1, num_speculative_tokens=6
    )
    bm = BlockManager(CacheSpec.build(config.num_blocks, config.page_size), True)
    scheduler = FIFOScheduler(config, bm)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]  # 10 tokens; "6" recurs, so 7 8 9 10 11 12 is proposed
    request = Request("r", prompt, SamplingParams(max_new_tokens=50))
    scheduler.add_request(request)
    out = scheduler.schedule()  # the prefill
    assert [s.spec_token_ids for s in out.scheduled] == [()]
    scheduler.advance(out)
    scheduler.update_from_output(
        out, StepOutput({request.index: [7]})
    )  # output [7]: "6 7" recurs, 8 9 10 11 12 5 follow it
    out = scheduler.schedule()
    (item,) = out.scheduled
    assert item.spec_token_ids == (8, 9, 10, 11, 12, 5) and item.num_tokens == 7
    assert item.token_ids == [7, 8, 9, 10, 11, 12, 5] and item.start == 10 and item.num_sample_rows == 7
    assert len(request.block_table) == 5  # 17 slots: positions 0 .. 16
    # The model accepts 8 and 9, then says 3: three tokens committed, four proposals rejected.
    scheduler.advance(out)
    scheduler.update_from_output(out, StepOutput({request.index: [8, 9, 3]}))
    assert request.output_token_ids == [7, 8, 9, 3]
    assert request.num_computed_tokens == 13  # positions 0 .. 12 (up to the accepted 9) hold valid KV
    assert len(request.block_table) == 4  # the block of positions 16.. is freed
    assert scheduler.speculator.num_proposed_tokens == 6 and scheduler.speculator.num_accepted_tokens == 2
    # Only blocks full of known tokens enter the prefix cache, as they are planned: positions 0..7 so far.
    assert sorted(bm._hash_to_block.values()) == sorted(request.block_table[:2])
    out = scheduler.schedule()
    (item,) = out.scheduled
    assert item.start == 13 and item.token_ids[0] == 3  # the bonus token is computed next
    assert sorted(bm._hash_to_block.values()) == sorted(request.block_table[:3])  # 0..11: prompt, 7, 8
    bm.check_consistency()


def test_generated_token_count_equals_off_when_a_stop_cuts_an_accepted_run(stories260k_dir, reference_greedy):
    """``num_generated_tokens`` counts an accepted run only up to a stop inside it (a stop token, a stop string,
    max_new_tokens, the model length), so it equals plain decoding's count exactly."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(stories260k_dir))
    line = reference_greedy[7]  # after 120 tokens of its golden output, stories260K repeats itself: all accepted
    prompt = line["prompt_token_ids"] + line["output_token_ids"][:120]
    off_engine = LLMEngine.from_pretrained(str(stories260k_dir), EngineConfig())
    plain = _generate(off_engine, [("p", prompt, SamplingParams(max_new_tokens=512 - len(prompt), ignore_eos=True))])[
        "p"
    ].output_token_ids
    near_the_end = prompt + plain[:-10]  # greedy continues with plain[-10:], then the model length stops it
    # The stop token and string: a token 6 or more tokens in, new to the output (and its text new to the output's
    # text) but in the prompt, so that n-gram lookup can propose it and more after it.
    at = next(
        i
        for i in range(6, len(plain))
        if plain[i] not in plain[:i]
        and plain[i] in prompt
        and tokenizer.decode(plain[i : i + 1]).strip() not in tokenizer.decode(plain[:i])
    )
    requests = [
        ("max", prompt, SamplingParams(max_new_tokens=11)),
        ("token", prompt, SamplingParams(max_new_tokens=24, stop_token_ids=(plain[at],))),
        ("string", prompt, SamplingParams(max_new_tokens=24, stop=(tokenizer.decode(plain[at : at + 1]).strip(),))),
        ("length", near_the_end, SamplingParams(max_new_tokens=40, ignore_eos=True)),
    ]
    for name, *rest in requests:  # each alone, so its count is its own
        (off, off_stats), (ngram, stats) = _off_and_ngram(
            stories260k_dir, [(name, *rest)], num_speculative_tokens=8, ngram_min=1
        )
        assert ngram[name].output_token_ids == off[name].output_token_ids, name
        assert stats.num_accepted_tokens > 0, name  # a verify step ran, so a run could overshoot the stop
        assert stats.num_generated_tokens == off_stats.num_generated_tokens, name
        if name != "string":  # a stop string's text cut may drop tokens from the output, not from the count
            assert off_stats.num_generated_tokens == len(off[name].output_token_ids), name


def test_the_switch_logs_each_way_also_when_a_run_starts_above_it(caplog):
    from cbrun.engine.spec_decode.speculative import Speculator

    speculator = Speculator(EngineConfig(speculative="ngram", speculative_max_batch=2))
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        assert [speculator.active(n) for n in (5, 4, 2, 1, 3)] == [False, False, True, True, False]
    messages = [r.getMessage() for r in caplog.records if "speculative decoding" in r.getMessage()]
    assert messages == [
        "speculative decoding paused, decoding plainly: 5 requests running (speculative_max_batch = 2)",
        "speculative decoding resumed: 2 requests running (speculative_max_batch = 2)",
    ]
