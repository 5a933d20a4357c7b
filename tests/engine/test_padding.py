"""Padded shapes for CUDA graphs, tested on the CPU: arithmetic, the graph cache, and that padding changes nothing."""

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cuda_graphs import GraphCache
from engine.padding import PaddedShape, PaddingPolicy, round_up
from tests.model_utils import assert_pool_balanced, random_llama_dir, random_prompts

VOCAB = 128


def test_round_up_and_shapes():
    assert [round_up(v, 8) for v in (0, 1, 8, 9)] == [0, 8, 8, 16]
    policy = PaddingPolicy(q_padding_interval_size=16, kv_padding_interval_size=32, max_batch_tokens=100,
                           max_requests=48, page_size=4)
    assert policy.shape(1, 1, 1, 1) == PaddedShape(16, 1, 8, 1)
    assert policy.shape(17, 3, 33, 3) == PaddedShape(32, 4, 16, 4)
    assert policy.shape(100, 48, 64, 70) == PaddedShape(112, 48, 16, 128)  # request count capped at the limit
    with pytest.raises(ValueError, match="exceeds"):
        policy.shape(101, 1, 1, 1)


def test_graph_cache_keys_and_bound():
    captured = []
    cache = GraphCache(2, lambda shape: captured.append(shape) or f"graph{len(captured)}")
    a, b, c = (PaddedShape(16, n, 8, n) for n in (1, 2, 4))
    assert cache.get(a) == "graph1" and cache.get(a) == "graph1"  # a hit does not capture again
    cache.get(b)
    cache.get(a)  # a is now the most recently used
    cache.get(c)  # evicts b
    assert a in cache and c in cache and b not in cache and len(cache) == 2
    assert cache.num_captures == 3
    with pytest.raises(ValueError, match="max_cached_graphs"):
        GraphCache(0, lambda s: None)


def run(prompts, padding: PaddingPolicy | None, **config):
    engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), EngineConfig(num_blocks=256, **config))
    engine.model_runner.padding = padding
    outputs = {o.request_id: o.output_token_ids for o in engine.generate(
        (i, p, SamplingParams(max_new_tokens=10)) for i, p in enumerate(prompts))}
    assert_pool_balanced(engine)
    return [outputs[i] for i in range(len(prompts))], engine


@pytest.mark.parametrize("q_interval,kv_interval", [(8, 16), (64, 256)])
def test_outputs_with_padding_equal_outputs_without(q_interval, kv_interval):
    prompts = random_prompts(12, VOCAB, 1, 30, seed=41)
    config = dict(page_size=4, max_batch_tokens=24, max_requests_per_batch=8)
    plain, _ = run(prompts, None, **config)
    policy = PaddingPolicy(q_interval, kv_interval, 24, 8, 4)
    padded, _ = run(prompts, policy, **config)
    assert padded == plain


def test_padded_slots_never_write_into_a_request_cache():
    prompts = random_prompts(3, VOCAB, 5, 9, seed=42)
    engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), EngineConfig(page_size=4, num_blocks=32))
    policy = PaddingPolicy(16, 32, 256, 8, 4)
    engine.model_runner.padding = policy
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(max_new_tokens=2))
    plan = engine.scheduler.schedule()
    inputs = engine.model_runner._prepare(plan.scheduled, None)
    md, logits_indices, shape = inputs, inputs.logits_indices, inputs.shape
    num_tokens = plan.num_batch_tokens
    slots = md.groups["full"].slot_mapping
    assert shape.num_tokens == 32 and slots.shape[0] == 32
    assert (slots[num_tokens:] == -1).all()  # padded tokens write nowhere
    real_pages = {page for s in plan.scheduled
                  for page in engine.block_manager.request_pages(engine.scheduler.requests[s.request_index])}
    assert set((slots[:num_tokens] // 4).tolist()) <= real_pages
    tables = md.groups["full"].block_tables
    assert (tables[len(plan.scheduled):] == 0).all()  # padded requests read the reserved padding chunk
    num_real = len(plan.scheduled)
    assert md.cu_seqlens_q.tolist()[num_real:] == [num_tokens] * (shape.num_requests - num_real + 1)
    assert logits_indices.shape[0] == shape.num_logit_rows
    cache = engine.model_runner.kv_cache
    cache.zero_pages_below(engine._num_touched_pages())  # as LLMEngine.step does before a plan runs
    before = cache.kv.clone()
    logits = engine.model_runner.execute(plan)  # runs with the padding in place
    assert logits.shape[0] == sum(s.samples for s in plan.scheduled)
    # NOTE: compared bit for bit: pages never handed out are uninitialised and may hold NaN (NaN != NaN).
    changed = (cache.kv.view(torch.uint8) != before.view(torch.uint8)).flatten(2).any(-1).any(0)  # (num_pages,)
    assert set(changed.nonzero().flatten().tolist()) <= real_pages
