"""FIFO and PrefillFirst scheduling: order, budgets, chunked prefill, safety margin, preemption, failures."""

from cbrun.engine.config import SCHEDULER_TYPES, EngineConfig
from cbrun.engine.core.block_manager import BlockManager
from cbrun.engine.core.cache_spec import CacheSpec
from cbrun.engine.core.plan import StepOutput
from cbrun.engine.core.request import Request, RequestStatus
from cbrun.engine.core.scheduler import SCHEDULERS, FIFOScheduler, PrefillFirstScheduler
from cbrun.engine.sampling_params import SamplingParams


def make(config: EngineConfig, cls=FIFOScheduler):
    bm = BlockManager(CacheSpec.build(config.num_blocks, config.page_size), config.allow_block_sharing)
    return cls(config, bm), bm


def req(name: str, n: int) -> Request:
    return Request(name, list(range(1, n + 1)), SamplingParams())


def run_step(scheduler, token=7):
    out = scheduler.schedule()
    scheduler.advance(out)
    scheduler.update_from_output(out, StepOutput({s.request_index: [token] for s in out.scheduled if s.samples}))
    return [(s.request_id, s.num_tokens) for s in out.scheduled], out


def test_fifo_decodes_first_then_prefills_then_new_with_chunking():
    config = EngineConfig(page_size=4, num_blocks=64, max_batch_tokens=10, allow_block_sharing=False)
    s, _ = make(config)
    for name, n in (("a", 3), ("b", 12), ("c", 5)):
        s.add_request(req(name, n))
    plan, _ = run_step(s)
    assert plan == [("a", 3), ("b", 7)]  # b is chunked; c waits
    plan, _ = run_step(s)
    assert plan == [("a", 1), ("b", 5), ("c", 4)]  # decode, running prefill, new request chunked
    plan, _ = run_step(s)
    assert plan == [("a", 1), ("b", 1), ("c", 1)]
    assert all(r.status is RequestStatus.DECODING for r in s.running)


def test_every_scheduler_type_names_its_scheduler():
    assert set(SCHEDULERS) == set(SCHEDULER_TYPES)
    assert SCHEDULERS["prefill_first"] is PrefillFirstScheduler and SCHEDULERS["fifo"] is FIFOScheduler


def test_prefill_first_finishes_prefills_before_decodes():
    config = EngineConfig(
        page_size=4, num_blocks=64, max_batch_tokens=6, scheduler_type="prefill_first", allow_block_sharing=False
    )
    s, _ = make(config, PrefillFirstScheduler)
    s.add_request(req("a", 2))
    s.add_request(req("b", 9))
    assert run_step(s)[0] == [("a", 2), ("b", 4)]
    assert run_step(s)[0] == [("b", 5), ("a", 1)]


def test_request_limit():
    config = EngineConfig(page_size=4, num_blocks=64, max_batch_tokens=100, max_requests_per_batch=2)
    s, _ = make(config)
    for i in range(3):
        s.add_request(req(f"r{i}", 2))
    assert [name for name, _ in run_step(s)[0]] == ["r0", "r1"]


def test_safety_margin_holds_back_new_prefills():
    config = EngineConfig(
        page_size=4, num_blocks=10, max_batch_tokens=100, safety_margin=0.5, allow_block_sharing=False
    )
    s, bm = make(config)
    s.add_request(req("a", 24))  # 6 blocks: free falls to 4 of 10, under the margin
    s.add_request(req("b", 4))
    assert run_step(s)[0] == [("a", 24)]  # b waits: a is running and the pool is under the margin
    assert run_step(s)[0] == [("a", 1)]
    s.running[0].status = RequestStatus.FINISHED
    bm.free(s.running.pop())
    assert run_step(s)[0] == [("b", 4)]  # the margin never holds back a request when nothing runs


def test_preemption_frees_newest_and_it_resumes_later():
    config = EngineConfig(page_size=2, num_blocks=4, max_batch_tokens=100, safety_margin=0.0, allow_block_sharing=False)
    s, bm = make(config)
    s.add_request(req("a", 4))  # 2 blocks
    s.add_request(req("b", 4))  # 2 blocks: pool full
    run_step(s)  # both prefilled, each sampled one token: 5 tokens, 4 computed
    plan, out = run_step(s)  # a needs a 3rd block: b is preempted
    assert plan == [("a", 1)] and out.num_preempted == 1
    b = s.waiting[0]
    assert b.request_id == "b" and b.status is RequestStatus.PENDING and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]  # its generated token is kept and recomputed
    bm.check_consistency()


def test_request_larger_than_cache_fails_alone():
    config = EngineConfig(page_size=4, num_blocks=2, max_batch_tokens=100, allow_block_sharing=False)
    s, _ = make(config)
    s.add_request(req("huge", 20))
    s.add_request(req("ok", 3))
    plan, out = run_step(s)
    failed = s.pop_finished()
    assert [r.request_id for r in failed] == ["huge"]
    assert "blocks" in failed[0].error and failed[0].finish_reason == "error"
    assert plan == [("ok", 3)]


def test_running_requests_never_exceed_the_request_limit():
    """Admitting more than one batch can serve would hold blocks without decoding (and force preemptions)."""
    config = EngineConfig(
        page_size=4, num_blocks=512, max_batch_tokens=64, max_requests_per_batch=3, scheduler_type="prefill_first"
    )
    s, _ = make(config, PrefillFirstScheduler)
    for i in range(8):
        s.add_request(req(f"r{i}", 5))
    for _ in range(6):
        plan, out = run_step(s)
        assert len(s.running) <= 3 and out.num_preempted == 0
