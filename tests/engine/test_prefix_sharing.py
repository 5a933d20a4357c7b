"""Prefix sharing changes what is computed, never what is generated."""

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.model_utils import assert_pool_balanced, random_llama_dir, random_prompts

VOCAB = 128
PAGE = 4


def make_engine(sharing: bool, num_blocks: int = 256, max_batch_tokens: int = 64, **settings) -> LLMEngine:
    config = EngineConfig(page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                          allow_block_sharing=sharing, **settings)
    return LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config)


def generate(engine: LLMEngine, prompts) -> list[list[int]]:
    outputs = {o.request_id: o.output_token_ids for o in engine.generate(
        (i, p, SamplingParams(max_new_tokens=8)) for i, p in enumerate(prompts))}
    assert_pool_balanced(engine)
    return [outputs[i] for i in range(len(prompts))]


def run(prompts, sharing: bool, num_blocks: int = 256, max_batch_tokens: int = 64, hash_fn=None):
    engine = make_engine(sharing, num_blocks, max_batch_tokens)
    if hash_fn is not None:
        engine.block_manager.hash_fn = hash_fn
    return generate(engine, prompts), engine.stats


def shared_prefix_prompts() -> list[list[int]]:
    base = random_prompts(1, VOCAB, 40, 40, seed=7)[0]
    tails = random_prompts(12, VOCAB, 1, 6, seed=8)
    prompts = []
    for length in (0, 1, PAGE, PAGE + 1, 3 * PAGE, 9 * PAGE):  # shared prefix lengths
        prompts += [base[:length] + tails[len(prompts)], base[:length] + tails[len(prompts) + 1]]
    prompts.append(base[:2 * PAGE])  # a whole prompt that is cached (exact multiple of the page size)
    prompts.append(base[:2 * PAGE])
    prompts.append(base[:PAGE + 2] + [5])  # diverges inside a block
    return prompts


def test_64_copies_of_one_prompt():
    prompt = random_prompts(1, VOCAB, 21, 21, seed=3)[0]
    off, _ = run([prompt] * 64, sharing=False)
    on, stats = run([prompt] * 64, sharing=True)
    assert on == off
    assert stats.num_cached_prompt_tokens >= 60 * 20 // PAGE * PAGE  # nearly every copy hit the cache


def test_shared_prefixes_of_every_length():
    prompts = shared_prefix_prompts()
    off, _ = run(prompts, sharing=False)
    on, stats = run(prompts, sharing=True)
    assert on == off
    assert stats.num_cached_prompt_tokens > 0


def test_eviction_then_same_prefixes_return():
    prompts = shared_prefix_prompts()
    prompts = prompts + random_prompts(10, VOCAB, 30, 40, seed=11) + prompts
    off, _ = run(prompts, sharing=False, num_blocks=40)
    on, stats = run(prompts, sharing=True, num_blocks=40)
    assert on == off
    assert stats.num_evicted_blocks > 0


def test_forced_hash_collisions_never_change_outputs():
    prompts = shared_prefix_prompts()
    off, _ = run(prompts, sharing=False)
    on, _ = run(prompts, sharing=True, hash_fn=lambda parent, tokens: bytes([sum(tokens) % 2]))
    assert on == off


def test_8_bit_prefix_hash_collides_but_never_serves_other_tokens():
    prompts = shared_prefix_prompts() + random_prompts(24, VOCAB, 20, 40, seed=12)
    off, _ = run(prompts, sharing=False)
    engine = make_engine(sharing=True, prefix_hash_bits=8)
    assert generate(engine, prompts) == off
    assert engine.block_manager.num_hash_collisions > 0  # collisions happened and were served as misses
    assert engine.stats.num_cached_prompt_tokens > 0  # true hits were still served


@pytest.mark.parametrize("max_batch_tokens", [5, 512])
def test_chunked_prefill_with_sharing(max_batch_tokens):
    prompts = shared_prefix_prompts()
    off, _ = run(prompts, sharing=False, max_batch_tokens=max_batch_tokens)
    on, _ = run(prompts, sharing=True, max_batch_tokens=max_batch_tokens)
    assert on == off
