"""The model runner's persistent batch: rows patched from plan deltas always equal the block manager's tables."""

import pytest

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.core.cache_spec import page_address
from cbrun.engine.core.plan import ScheduledRequest
from cbrun.engine.worker.input_batch import PersistentBatch
from tests.model_utils import assert_pool_balanced, random_llama_dir, random_prompts

VOCAB = 128


def entry(index: int, block_start: int, new_blocks, sliding_start: int = 0, new_sliding=()) -> ScheduledRequest:
    return ScheduledRequest(
        index,
        f"r{index}",
        0,
        1,
        [5],
        0,
        True,
        False,
        range(0),
        block_start,
        list(new_blocks),
        sliding_start,
        list(new_sliding),
    )


def test_rows_join_grow_and_are_released_and_reused():
    batch = PersistentBatch(["full"], num_rows=2, width=2)
    rows, lengths, sliding = batch.update([entry(7, 0, [4, 9]), entry(3, 0, [2])], "full", None)
    assert rows.tolist() == [0, 1] and lengths.tolist() == [2, 1] and sliding is None
    rows, lengths, _ = batch.update([entry(3, 1, []), entry(7, 2, [12, 13, 14])], "full", None)  # width grows
    assert rows.tolist() == [1, 0] and lengths.tolist() == [1, 5]
    tables = batch.tables["full"].gather(rows, lengths, 5)
    assert tables.tolist() == [[2, 0, 0, 0, 0], [4, 9, 12, 13, 14]]
    # A trimmed table (rejected proposals) is shorter than the row: the gather stops at the plan's length.
    rows, lengths, _ = batch.update([entry(7, 3, [])], "full", None)
    assert batch.tables["full"].gather(rows, lengths, 4).tolist() == [[4, 9, 12, 0]]
    batch.release([7, 99])  # 99 was never in the batch
    assert len(batch) == 1
    rows, _, _ = batch.update([entry(8, 0, [6])], "full", None)  # takes 7's row
    assert rows.tolist() == [0]
    rows, _, _ = batch.update([entry(10, 0, [1]), entry(11, 0, [1])], "full", None)  # a third row is added
    assert sorted(rows.tolist()) == [2, 3] and len(batch) == 4


def test_a_delta_for_a_request_the_batch_never_saw_is_refused():
    batch = PersistentBatch(["full", "sliding"], num_rows=1, width=1)
    with pytest.raises(RuntimeError, match="holds none of its earlier blocks"):
        batch.update([entry(1, 2, [5])], "full", "sliding")
    rows, lengths, sliding = batch.update([entry(2, 0, [5], 0, [6, 7])], "full", "sliding")
    assert lengths.tolist() == [1] and sliding.tolist() == [2]
    assert batch.tables["sliding"].gather(rows, sliding, 3).tolist() == [[6, 7, 0]]


@pytest.mark.parametrize(
    "config",
    [
        dict(num_blocks=16, max_batch_tokens=32),  # soft resets, chunked prefill, prefix sharing
        dict(num_blocks=16, max_batch_tokens=32, cpu_offload_space=0.001, scheduler_type="prefill_first"),  # swaps
        dict(num_blocks=64, max_batch_tokens=40, speculative="ngram"),  # rejected proposals trim tables
    ],
)
def test_runner_tables_equal_the_block_managers_at_every_step(config):
    engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), EngineConfig(page_size=4, **config))
    runner, requests = engine.model_runner, engine.scheduler.requests
    layers = runner.layers_per_block["full"]
    prepare, checked = runner.step_inputs.prepare, []

    def checking_prepare(plan, previous):
        inputs = prepare(plan, previous)
        scheduled = plan.scheduled
        tables = inputs.groups["full"].block_tables.numpy()
        for i, item in enumerate(scheduled):
            blocks = requests[item.request_index].block_table
            assert tables[i, : len(blocks)].tolist() == [page_address(b, layers) for b in blocks]  # layer 0's pages
            assert not tables[i, len(blocks) :].any()
            assert item.num_blocks == len(blocks)
        checked.append(len(scheduled))
        return inputs

    runner.step_inputs.prepare = checking_prepare
    prompts = random_prompts(16, VOCAB, 1, 24, seed=3)
    prompts += [p[:8] + q for p, q in zip(prompts[:4], random_prompts(4, VOCAB, 4, 8, seed=4))]  # shared prefixes
    outputs = list(engine.generate((i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(prompts)))
    assert len(outputs) == len(prompts) and all(o.finish_reason == "length" for o in outputs)
    assert sum(checked) > len(prompts)
    stats = engine.stats
    if "cpu_offload_space" in config:
        assert stats.num_offloads > 0
    elif config["num_blocks"] == 16:
        assert stats.num_soft_resets > 0
    assert_pool_balanced(engine)
    assert len(runner.input_batch) <= engine.config.max_requests_per_batch
