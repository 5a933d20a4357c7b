"""Throughput defaults: device batch limits, ``num_threads = "auto"``, a default cache sized to the work, and a
pool that is zeroed only where it is used."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.config import DEFAULT_BATCH_LIMITS, DEFAULT_PAGE_SIZE
from cbrun.engine.core.cache_pool import NUM_RESERVED_CHUNKS, CachePool
from cbrun.engine.core.cache_sizing import useful_blocks
from cbrun.engine.worker.kv_cache import KVCache
from cbrun.engine.worker.threads import (
    TINY_MODEL_PARAMS,
    physical_cores,
    resolve_attention_threads,
    resolve_num_threads,
)
from tests.model_utils import hf_greedy, random_llama_dir, random_prompts


def test_batch_limits_default_by_device_and_explicit_values_stay():
    cpu, cuda = EngineConfig(), EngineConfig(device="cuda")
    assert (cpu.max_requests_per_batch, cpu.max_batch_tokens) == DEFAULT_BATCH_LIMITS["cpu"] == (256, 1024)
    assert (cuda.max_requests_per_batch, cuda.max_batch_tokens) == DEFAULT_BATCH_LIMITS["cuda"] == (256, 8192)
    assert cpu.num_threads == "auto"
    set_by_hand = EngineConfig(max_requests_per_batch=8, max_batch_tokens=64)
    assert (set_by_hand.max_requests_per_batch, set_by_hand.max_batch_tokens) == (8, 64)


def test_page_size_defaults_by_device_and_explicit_values_stay():
    assert EngineConfig().page_size == DEFAULT_PAGE_SIZE["cpu"] == 64
    assert EngineConfig(device="cuda:0").page_size == DEFAULT_PAGE_SIZE["cuda"] == 16
    assert EngineConfig(page_size=8).page_size == EngineConfig(device="cuda", page_size=8).page_size == 8
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(page_size=0)


def test_auto_device_takes_the_defaults_of_the_device_it_resolves_to():
    # A manifest's device is "auto" until the job resolves it: the defaults must be the resolved device's.
    auto = EngineConfig(device="auto")
    assert (auto.page_size, auto.max_requests_per_batch, auto.max_batch_tokens) == (None, None, None)
    cuda = replace(auto, device="cuda:0")
    assert (cuda.page_size, cuda.max_requests_per_batch, cuda.max_batch_tokens) == (16, 256, 8192)
    cpu = replace(EngineConfig(device="auto", page_size=32), device="cpu")
    assert (cpu.page_size, cpu.max_requests_per_batch, cpu.max_batch_tokens) == (32, 256, 1024)


@pytest.mark.parametrize("value", ["many", 0, -1, 1.5, True])
def test_bad_num_threads_is_refused(value):
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=value)


def test_auto_threads_rule():
    assert resolve_num_threads("auto", TINY_MODEL_PARAMS - 1, "cpu") == 1
    assert resolve_num_threads("auto", TINY_MODEL_PARAMS, "cpu") == physical_cores() >= 1
    assert resolve_num_threads("auto", 10**9, "cuda") is None  # torch's default on an accelerator
    assert resolve_num_threads(3, 10**9, "cpu") == 3 and resolve_num_threads(None, 10**9, "cpu") is None


def test_auto_attention_threads_rule():
    assert resolve_attention_threads("auto", "cpu") == physical_cores()  # even where torch keeps one thread
    assert resolve_attention_threads("auto", "cuda") is None
    assert resolve_attention_threads(3, "cpu") is None and resolve_attention_threads(None, "cpu") is None


def test_auto_threads_set_one_thread_for_a_tiny_model():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        engine = LLMEngine.from_pretrained(str(random_llama_dir()), EngineConfig(num_blocks=16))
        assert torch.get_num_threads() == 1
        assert engine.model_runner.cpu_kernel_threads == physical_cores()
        torch.set_num_threads(2)
        LLMEngine.from_pretrained(str(random_llama_dir()), EngineConfig(num_blocks=16, num_threads=None))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_useful_blocks_follow_the_expected_work():
    config = EngineConfig(page_size=16, max_requests_per_batch=8)
    assert useful_blocks(config, 256) == 8 * 16  # every slot grows to the model's length
    assert useful_blocks(config, 256, expected_requests=3) == 3 * 16
    assert useful_blocks(config, 256, expected_requests=100) == 8 * 16
    # 3 requests of 40 tokens in all: 120 tokens = 8 blocks, plus a partly filled block each.
    assert useful_blocks(config, 256, expected_requests=3, expected_tokens=120) == 8 + 3


def test_engine_cache_is_sized_to_the_expected_requests():
    engine = LLMEngine.from_pretrained(str(random_llama_dir()), EngineConfig(page_size=16), expected_requests=2)
    assert engine.num_blocks == 2 * 256 // 16


def test_pool_records_the_highest_chunk_handed_out():
    pool = CachePool(NUM_RESERVED_CHUNKS + 4)
    assert pool.num_touched_chunks == NUM_RESERVED_CHUNKS
    first, second = pool.take(), pool.take()
    assert (first, second) == (NUM_RESERVED_CHUNKS, NUM_RESERVED_CHUNKS + 1)
    assert pool.num_touched_chunks == NUM_RESERVED_CHUNKS + 2
    pool.give_back(second)
    assert pool.take() == second and pool.num_touched_chunks == NUM_RESERVED_CHUNKS + 2


def test_kv_cache_zeroes_pages_only_up_to_the_mark():
    spec = SimpleNamespace(num_pages=6, page_size=4, num_cpu_pages=0)  # the geometry KVCache reads
    cache = KVCache(spec, 1, 2, torch.float32, torch.device("cpu"), num_zeroed_pages=2)
    assert cache.num_zeroed_pages == 2 and torch.equal(cache.kv[:, :2], torch.zeros(2, 2, 4, 1, 2))
    cache.kv[:, 2:].fill_(float("nan"))
    cache.zero_pages_below(4)
    assert torch.equal(cache.kv[:, :4], torch.zeros(2, 4, 4, 1, 2)) and cache.kv[:, 4:].isnan().all()
    cache.kv[:, 2:4].fill_(7.0)
    cache.zero_pages_below(3)  # already zeroed once: K/V written since then is kept
    assert (cache.kv[:, 2:4] == 7.0).all()


def test_untouched_pages_may_hold_anything_outputs_equal_transformers():
    """Poison every page the pool has not handed out with NaN: the engine zeroes pages as it first uses them, so
    greedy outputs still equal transformers'."""
    model_dir = random_llama_dir()
    engine = LLMEngine.from_pretrained(str(model_dir), EngineConfig(page_size=4, max_requests_per_batch=4))
    cache = engine.model_runner.kv_cache
    assert cache.num_zeroed_pages < cache.kv.shape[1]  # the pool was not zero-filled
    cache.kv[:, cache.num_zeroed_pages :].fill_(float("nan"))
    prompts = random_prompts(6, 128, min_len=3, max_len=9)
    params = SamplingParams(max_new_tokens=6)
    outputs = {o.request_id: o.output_token_ids for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
    assert outputs == {i: hf_greedy(model_dir, p, 6) for i, p in enumerate(prompts)}
