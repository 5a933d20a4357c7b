"""Prefix sharing changes what is computed, never what is generated."""

import pytest

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from tests.model_utils import assert_pool_balanced, random_llama_dir, random_prompts

VOCAB = 128
PAGE = 4


def make_engine(sharing: bool, num_blocks: int = 256, max_batch_tokens: int = 64, **settings) -> LLMEngine:
    config = EngineConfig(
        page_size=PAGE,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        allow_block_sharing=sharing,
        **settings,
    )
    return LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config)


def generate(engine: LLMEngine, prompts) -> list[list[int]]:
    outputs = {
        o.request_id: o.output_token_ids
        for o in engine.generate((i, p, SamplingParams(max_new_tokens=8)) for i, p in enumerate(prompts))
    }
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
    prompts.append(base[: 2 * PAGE])  # a whole prompt that is cached (exact multiple of the page size)
    prompts.append(base[: 2 * PAGE])
    prompts.append(base[: PAGE + 2] + [5])  # diverges inside a block
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


def chain_collision_prompts(page: int) -> list[list[int]]:
    """P0 = X+Y+5, P1 = X+Z+5, P2 = X+Y+Z+5, with Z chosen so that P2's third block hash equals P1's second.

    Under 8-bit block hashes, P2's blocks X, Y and Z each find a cached block holding the same tokens, but the Z
    block was computed after X alone, not after X+Y: only a check of the block's place in the chain refuses it.
    """
    from cbrun.engine.core.block_manager import ROOT_HASH, truncated_block_hash

    hash_fn = truncated_block_hash(8)
    x, y = (random_prompts(1, VOCAB, page, page, seed=s)[0] for s in (21, 22))
    h_x = hash_fn(ROOT_HASH, tuple(x))
    h_xy = hash_fn(h_x, tuple(y))
    for seed in range(100, 10_000):
        z = random_prompts(1, VOCAB, page, page, seed=seed)[0]
        if h_xy != h_x and hash_fn(h_xy, tuple(z)) == hash_fn(h_x, tuple(z)):
            return [x + y + [5], x + z + [5], x + y + z + [5]]
    raise AssertionError("no colliding block found")


def test_cached_block_from_another_chain_is_never_served():
    page = 16
    prompts = chain_collision_prompts(page)
    config = dict(page_size=page, num_blocks=64, max_batch_tokens=64)
    off = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), EngineConfig(allow_block_sharing=False, **config))
    on = LLMEngine.from_pretrained(
        str(random_llama_dir(VOCAB)), EngineConfig(allow_block_sharing=True, prefix_hash_bits=8, **config)
    )
    expected = generate(off, prompts[:2]) + generate(off, prompts[2:])
    assert generate(on, prompts[:2]) + generate(on, prompts[2:]) == expected
    assert on.block_manager.num_hash_collisions == 1  # the Z block's hit, refused
    assert on.stats.num_cached_prompt_tokens == 3 * page  # X for P1, then X+Y for P2
