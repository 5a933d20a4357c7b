"""Which steps are graphed and how they are padded, tested on the CPU: the buckets, and that padded tokens and
requests touch no request's cache."""

from types import SimpleNamespace

import pytest
import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.core.plan import ScheduledRequest
from cbrun.engine.worker.padding import GraphBuckets, PaddedShape, capture_sizes
from cbrun.engine.worker.step_inputs import StepInputBuilder
from tests.model_utils import random_llama_dir, random_prompts

VOCAB = 128


def test_capture_sizes_are_vllms_cut_at_the_limit():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(30) == (1, 2, 4, 8, 16, 24, 30)
    assert len(capture_sizes(256)) == 35


def test_bucket_shapes():
    buckets = GraphBuckets(max_batch_size=16, max_query_len=4, max_model_len=100, page_size=8)
    assert buckets.shape(1, 1) == PaddedShape(1, 1, 13, 1, 1)
    assert buckets.shape(5, 1) == PaddedShape(8, 8, 13, 8, 1)
    assert buckets.shape(9, 3) == PaddedShape(48, 16, 13, 48, 3)
    assert buckets.shape(17, 1) is None  # more requests than the largest bucket: eager
    assert buckets.shape(2, 5) is None  # a longer query than any verify step: eager
    assert buckets.max_shape == PaddedShape(64, 16, 13, 64, 4)
    with pytest.raises(ValueError, match="max_batch_size"):
        GraphBuckets(0, 1, 100, 8)


def test_padded_slots_never_write_into_a_request_cache():
    engine = LLMEngine.from_pretrained(
        str(random_llama_dir(VOCAB)),
        EngineConfig(page_size=4, num_blocks=32, cuda_graphs="emulate", loader="transformers", attention_backend="cpu"),
    )
    for i, p in enumerate(random_prompts(3, VOCAB, 5, 9, seed=42)):
        engine.add_request(i, p, SamplingParams(max_new_tokens=4))
    engine.step()
    assert engine.stats.num_cuda_graph_replays == 0  # the prefill ran eagerly
    plan = engine.scheduler.schedule()
    inputs = engine.model_runner.step_inputs.prepare(plan, None)
    shape = inputs.shape
    assert shape is not None and shape.num_requests == 4 and shape.query_len == 1  # 3 decodes in bucket 4
    slots = inputs.groups["full"].slot_mapping
    assert slots.shape[0] == 4 and slots[3] == -1  # the padded token writes nowhere
    real_pages = {
        page
        for s in plan.scheduled
        for page in engine.block_manager.request_pages(engine.scheduler.requests[s.request_index])
    }
    assert set((slots[:3] // 4).tolist()) <= real_pages
    assert (inputs.groups["full"].block_tables[3:] == 0).all()  # the padded request reads the padding chunk
    assert inputs.cu_seqlens_q.tolist() == [0, 1, 2, 3, 3] and inputs.seqlens_k[3] == 0
    cache = engine.model_runner.kv_cache
    cache.zero_pages_below(engine._num_touched_pages())  # as LLMEngine.step does before a plan runs
    before = cache.kv.clone()
    logits = engine.model_runner.execute(plan)
    assert logits.shape[0] == 3 and engine.stats.num_cuda_graph_replays == 1
    # NOTE: compared bit for bit: pages never handed out are uninitialised and may hold NaN (NaN != NaN).
    changed = (cache.kv.view(torch.uint8) != before.view(torch.uint8)).flatten(2).any(-1).any(0)  # (num_pages,)
    assert set(changed.nonzero().flatten().tolist()) <= real_pages


def _entry(num_tokens: int, proposals: int = 0, samples: bool = True, logprobs: range = range(0)):
    """A plan entry with only the fields ``_graph_shape`` reads set meaningfully."""
    return ScheduledRequest(
        0, "r", 10, num_tokens, [1] * num_tokens, 0, samples, False, logprobs, 0, (), 0, (), tuple([1] * proposals)
    )


@pytest.mark.parametrize(
    "entries,query_len",
    [
        ([_entry(1)] * 3, 1),  # decode: graphed, bucket 4
        ([_entry(3, 2)] * 2, 3),  # a uniform verify step: graphed
        ([_entry(3, 2), _entry(2, 1)], None),  # uneven proposals: eager
        ([_entry(1), _entry(5)], None),  # a prefill chunk beside a decode: eager
        ([_entry(1), _entry(1, samples=False)], None),  # a chunk that samples nothing: eager
        ([_entry(1, logprobs=range(10, 11))], None),  # a step scoring prompt tokens: eager
        ([_entry(1)] * 9, None),  # more requests than the largest bucket: eager
    ],
)
def test_only_decode_and_uniform_verify_steps_are_graphed(entries, query_len):
    runner = SimpleNamespace(graph_buckets=GraphBuckets(8, 3, 64, 4))
    num_tokens = sum(e.num_tokens for e in entries)
    num_rows = sum(e.num_sample_rows + len(e.prompt_logprob_positions) for e in entries)
    shape = StepInputBuilder._graph_shape(runner, entries, num_tokens, num_rows)
    assert (shape.query_len if shape else None) == query_len
    if shape is not None:
        assert shape.num_requests in (2, 4) and shape.num_tokens == shape.num_requests * query_len
