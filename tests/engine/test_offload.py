"""Memory pressure: offloading to CPU swap and soft reset never change a token, and nothing leaks or deadlocks."""

import time

import pytest

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from tests.model_utils import assert_pool_balanced, random_llama_dir, random_prompts

VOCAB = 128
PAGE = 8
NEW_TOKENS = 64


def run(config: EngineConfig, prompts, params_for):
    engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config)
    outputs = {o.request_id: o for o in engine.generate((i, p, params_for(i)) for i, p in enumerate(prompts))}
    assert_pool_balanced(engine)
    assert engine.block_manager.swap_pool.num_free_slots == engine.block_manager.swap_pool.num_slots
    return [outputs[i] for i in range(len(prompts))], engine.stats


def greedy(i):
    return SamplingParams(max_new_tokens=NEW_TOKENS)


def seeded(i):
    return SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(24, VOCAB, 1, 24, seed=5)


@pytest.fixture(scope="module")
def unconstrained(prompts):
    config = EngineConfig(page_size=PAGE, num_blocks=512, max_batch_tokens=256)
    return {name: run(config, prompts, fn)[0] for name, fn in (("greedy", greedy), ("seeded", seeded))}


@pytest.mark.parametrize("scheduler_type", ["fifo", "prefill_first"])
@pytest.mark.parametrize("swap_gib", [0.0, 0.001])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_tight_cache_matches_unconstrained(prompts, unconstrained, scheduler_type, swap_gib, mode):
    config = EngineConfig(
        page_size=PAGE,
        num_blocks=16,
        max_batch_tokens=32,
        scheduler_type=scheduler_type,
        cpu_offload_space=swap_gib,
        allow_block_sharing=False,
    )
    outputs, stats = run(config, prompts, greedy if mode == "greedy" else seeded)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in unconstrained[mode]]
    if swap_gib:
        assert stats.num_offloads > 0
    else:
        assert stats.num_soft_resets > 0 and stats.num_offloads == 0


def test_swap_too_small_falls_back_to_soft_reset(prompts, unconstrained):
    # One CPU slot holds a single block: most offloads cannot swap and soft reset instead.
    config = EngineConfig(
        page_size=PAGE,
        num_blocks=16,
        max_batch_tokens=32,
        cpu_offload_space=2 * 2 * 64 * PAGE * 2 * 4 / 2**30,
        allow_block_sharing=False,
    )
    outputs, stats = run(config, prompts, greedy)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in unconstrained["greedy"]]
    assert stats.num_soft_resets > 0


def test_cache_fits_one_request_at_a_time_without_deadlock(prompts, unconstrained):
    # Every request needs up to ceil((24 + 64) / 8) = 11 blocks; 11 blocks hold exactly one of the longest.
    config = EngineConfig(
        page_size=PAGE, num_blocks=11, max_batch_tokens=64, safety_margin=0.0, allow_block_sharing=False
    )
    start = time.monotonic()
    outputs, _ = run(config, prompts, greedy)
    assert time.monotonic() - start < 120
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in unconstrained["greedy"]]


def test_request_larger_than_cache_fails_alone(prompts, unconstrained):
    huge = random_prompts(1, VOCAB, 100, 100, seed=9)[0]  # 13 blocks of 8 > 11
    config = EngineConfig(page_size=PAGE, num_blocks=11, max_batch_tokens=64, allow_block_sharing=False)
    outputs, stats = run(config, [huge] + prompts, greedy)
    assert outputs[0].finish_reason == "error" and "blocks" in outputs[0].error
    assert [o.output_token_ids for o in outputs[1:]] == [o.output_token_ids for o in unconstrained["greedy"]]
    assert stats.num_failed_requests == 1


def test_stopping_generate_early_aborts_and_frees_everything(prompts):
    config = EngineConfig(
        page_size=PAGE, num_blocks=16, max_batch_tokens=32, cpu_offload_space=0.001, allow_block_sharing=False
    )
    engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config)
    stream = engine.generate((i, p, greedy(i)) for i, p in enumerate(prompts))
    next(stream)
    stream.close()  # the caller stops: the rest is aborted
    assert not engine.has_unfinished_requests()
    assert_pool_balanced(engine)
    assert engine.block_manager.swap_pool.num_free_slots == engine.block_manager.swap_pool.num_slots
    again = list(engine.generate([("x", prompts[0], greedy(0))]))  # a reused engine starts clean
    assert [o.request_id for o in again] == ["x"]
