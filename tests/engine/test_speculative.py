"""Speculative decoding (n-gram proposals): greedy outputs token-identical to speculation off.

Oracles: llama2.c's goldens for stories260K, transformers' ``generate`` for random Llama / Qwen2, and the engine
with speculation off (stop tokens, stop strings, max_new_tokens, the model length, tight caches, prefix sharing).
Host-processed greedy rows and seeded sampled rows are checked here for a draft model, too (``SPECULATION``).
"""

from __future__ import annotations

import logging

import pytest
import transformers

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.spec_decode.speculative import NgramIndex, NgramProposer, accept_greedy
from tests.engine import spec_utils
from tests.engine.spec_utils import VOCAB
from tests.model_utils import assert_same_outputs_and_logprobs, hf_greedy, random_llama_dir, random_prompts

#: EngineConfig fields per speculation kind: n-gram lookup, the target as its own draft (every proposal right), and
#: a random draft (most proposals wrong).
SPECULATION = {
    "ngram": lambda model_dir: dict(speculative="ngram", ngram_min=1),
    "draft": lambda model_dir: dict(speculative="draft", draft_model=str(model_dir)),
    "random-draft": lambda model_dir: dict(speculative="draft", draft_model=str(spec_utils.random_draft_dir())),
}


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
            str(random_llama_dir(VOCAB)),
            EngineConfig(speculative="ngram", async_batching="on", num_blocks=64),
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
    spec_utils.assert_goldens(
        spec_utils.generate(engine, spec_utils.golden_requests(reference_greedy)), reference_greedy
    )
    stats = engine.stats
    assert stats.num_verify_steps > 0 and 0 < stats.num_accepted_tokens <= stats.num_proposed_tokens
    assert stats.as_dict()["acceptance_rate"] == stats.num_accepted_tokens / stats.num_proposed_tokens
    assert 1 < stats.mean_tokens_per_verify_step <= 6


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ngram_equals_transformers_generate(arch):
    model_dir = spec_utils.target_model_dir(arch)
    prompts = spec_utils.repetitive_prompts(6) + random_prompts(4, VOCAB, 1, 20, seed=7)
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
    outputs = spec_utils.generate(engine, [(i, p, params) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert outputs[i].output_token_ids == hf_greedy(model_dir, prompt, 20), f"prompt {i}"
    assert engine.stats.num_accepted_tokens > 0


def _off_and_ngram(model_dir, requests, **config):
    return spec_utils.off_and_on(model_dir, requests, "ngram", **config)


@pytest.mark.parametrize("config", spec_utils.PRESSURE_CONFIGS, ids=spec_utils.PRESSURE_IDS)
def test_ngram_equals_off_under_pressure_and_sharing(config):
    model_dir = random_llama_dir(VOCAB)
    shared = spec_utils.repetitive_prompts(1, seed=11)[0][:16]
    prompts = [shared + p[:6] for p in spec_utils.repetitive_prompts(6)] + spec_utils.repetitive_prompts(4, seed=5)
    requests = [(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(prompts)]
    (off, off_stats), (ngram, ngram_stats) = _off_and_ngram(
        model_dir, requests, num_speculative_tokens=4, ngram_min=1, ngram_max=3, **config
    )
    spec_utils.assert_same_as_off(ngram, off)
    assert ngram_stats.num_accepted_tokens > 0
    spec_utils.assert_pressure_happened(config, off_stats, ngram_stats)


def test_ngram_stops_inside_an_accepted_run_where_plain_decoding_stops(stories260k_dir):
    """Stop tokens, stop strings, max_new_tokens and the model length cut an accepted run exactly."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(stories260k_dir))
    story = tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play outside.")
    prompt = story + story[1:]  # the story twice: n-gram lookup proposes its continuation
    off_engine = LLMEngine.from_pretrained(str(stories260k_dir), EngineConfig())
    plain = spec_utils.generate(off_engine, [("p", prompt, SamplingParams(max_new_tokens=40))])["p"].output_token_ids
    stop_token = plain[7]
    stop_text = tokenizer.decode(plain[10:12])
    requests = [
        ("max", prompt, SamplingParams(max_new_tokens=9)),
        ("token", prompt, SamplingParams(max_new_tokens=40, stop_token_ids=(stop_token,))),
        ("string", prompt, SamplingParams(max_new_tokens=40, stop=(stop_text,))),
        ("length", story, SamplingParams(max_new_tokens=600, ignore_eos=True)),  # runs into the model length
    ]
    (off, _), (ngram, stats) = _off_and_ngram(stories260k_dir, requests, num_speculative_tokens=6, ngram_min=1)
    spec_utils.assert_same_stops(ngram, off)
    assert off["token"].stop_reason == stop_token and off["string"].stop_reason == stop_text
    assert off["length"].finish_reason == "length" and len(off["length"].output_token_ids) > 40
    assert stats.num_accepted_tokens > 0


def test_switch_to_plain_decoding_above_speculative_max_batch(caplog):
    model_dir = random_llama_dir(VOCAB)
    prompts = spec_utils.repetitive_prompts(8)
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


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_host_processed_greedy_rows_equal_off(kind):
    """Penalties, min_new_tokens and log-probabilities see the accepted tokens before each verified position."""
    model_dir = random_llama_dir(VOCAB)
    prompts = spec_utils.repetitive_prompts(6)
    requests = [(i, p, spec_utils.HOST_PROCESSED_PARAMS[i % 3]) for i, p in enumerate(prompts)]
    (off, _), (spec, stats) = spec_utils.off_and_on(
        model_dir, requests, **SPECULATION[kind](model_dir), num_blocks=256, page_size=4
    )
    assert_same_outputs_and_logprobs(spec, off)
    assert stats.num_accepted_tokens > 0


@pytest.mark.parametrize("kind", ["ngram", "random-draft"])
def test_seeded_sampled_rows_are_reproducible_and_independent_of_batch(kind):
    model_dir = random_llama_dir(VOCAB)
    prompts = spec_utils.repetitive_prompts(6)
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, seed=1234)
    config = EngineConfig(**SPECULATION[kind](model_dir), num_blocks=256, page_size=4)
    alone = spec_utils.generate(LLMEngine.from_pretrained(str(model_dir), config), [("x", prompts[0], params)])["x"]
    again = spec_utils.generate(LLMEngine.from_pretrained(str(model_dir), config), [("x", prompts[0], params)])["x"]
    others = [(i, p, SamplingParams(max_new_tokens=12, temperature=1.0, seed=i)) for i, p in enumerate(prompts)]
    engine = LLMEngine.from_pretrained(str(model_dir), config)
    crowded = spec_utils.generate(engine, others[:3] + [("x", prompts[0], params)] + others[3:])["x"]
    assert crowded.output_token_ids == alone.output_token_ids == again.output_token_ids
    assert engine.stats.num_verify_steps > 0


@pytest.mark.slow
def test_sampling_with_speculation_keeps_the_target_distribution(tmp_path):
    """Rejection sampling with point-mass (n-gram) proposals: the verified tokens' frequencies over many seeded
    draws match a toy model's known distribution (chi-square, fixed seeds, so the test is deterministic)."""
    import torch

    vocab, num_draws = 8, 1500
    # Next token: the successor (a + 1) with probability 0.6, any other with 0.4 / 7.
    transitions = torch.full((vocab, vocab), 0.4 / (vocab - 1), dtype=torch.float64)
    transitions[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] = 0.6
    model_dir = spec_utils.markov_model_dir(transitions.float(), tmp_path / "markov")
    prompt = list(range(vocab)) * 2  # n-gram lookup proposes each token's successor
    tokens, stats = spec_utils.markov_draws(model_dir, prompt, num_draws, speculative="ngram", ngram_min=1, ngram_max=2)
    assert stats.num_verify_steps == stats.num_proposed_tokens == num_draws  # t2 verified, t3 the bonus
    assert 0.5 < stats.acceptance_rate < 0.7  # p(successor) = 0.6: both branches of the rule ran often
    spec_utils.assert_markov_draws(tokens, transitions.numpy(), prompt[-1])


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
    plain = spec_utils.generate(
        off_engine, [("p", prompt, SamplingParams(max_new_tokens=512 - len(prompt), ignore_eos=True))]
    )["p"].output_token_ids
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
