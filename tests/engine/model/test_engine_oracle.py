"""Greedy outputs equal transformers' own generate, whatever the batch composition, chunk size or page size."""

import pytest

from cbrun.engine import EngineConfig, SamplingParams
from tests.model_utils import hf_greedy, random_llama_dir, random_prompts, run_engine

VOCAB = 128
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def oracle():
    model_dir = random_llama_dir(VOCAB)
    prompts = random_prompts(32, VOCAB, 1, 40)
    expected = [hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts]
    return model_dir, prompts, expected


@pytest.mark.parametrize("page_size,max_batch_tokens", [(4, 16), (16, 256), (64, 7), (8, 8)])
def test_greedy_matches_transformers(oracle, page_size, max_batch_tokens):
    model_dir, prompts, expected = oracle
    config = EngineConfig(page_size=page_size, max_batch_tokens=max_batch_tokens, num_blocks=400)
    outputs = run_engine(model_dir, prompts, config, SamplingParams(max_new_tokens=NEW_TOKENS))
    for i, want in enumerate(expected):
        assert outputs[i].output_token_ids == want, f"prompt {i} (len {len(prompts[i])})"
        assert outputs[i].finish_reason == "length"


def test_small_request_limit_and_tiny_cache_still_match(oracle):
    """Two requests per batch and a cache that forces preemption: outputs do not change."""
    model_dir, prompts, expected = oracle
    config = EngineConfig(page_size=4, max_batch_tokens=32, max_requests_per_batch=2, num_blocks=14)
    outputs = run_engine(model_dir, prompts, config, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [outputs[i].output_token_ids for i in range(len(prompts))] == expected


@pytest.mark.parametrize("page_size", [4, 8])
def test_chunked_prefill_equals_one_shot(page_size):
    """Prompts of exact multiples of page_size, and chunk boundaries on block boundaries."""
    model_dir = random_llama_dir(VOCAB)
    lengths = [page_size, 2 * page_size, 3 * page_size, 3 * page_size + 1, 5 * page_size - 1]
    prompts = [random_prompts(1, VOCAB, n, n, seed=n)[0] for n in lengths]
    params = SamplingParams(max_new_tokens=10)
    one_shot = run_engine(
        model_dir,
        prompts,
        EngineConfig(page_size=page_size, max_batch_tokens=512, num_blocks=64, allow_block_sharing=False),
        params,
    )
    for chunk in (page_size, 2 * page_size, page_size + 1, 3):
        chunked = run_engine(
            model_dir,
            prompts,
            EngineConfig(page_size=page_size, max_batch_tokens=chunk, num_blocks=64, allow_block_sharing=False),
            params,
        )
        for i in range(len(prompts)):
            assert chunked[i].output_token_ids == one_shot[i].output_token_ids, (chunk, lengths[i])
