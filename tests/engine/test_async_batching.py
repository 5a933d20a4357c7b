"""Async batching's bookkeeping on the CPU: step N+1 is planned and launched before step N's tokens are read.

The CPU has no stream to overlap with, so ``overlap_steps`` runs the async path synchronously: pending tokens,
device-side carry of sampled tokens into the next step's inputs, dropped tokens of requests that finished while a
step was in flight. Every output must equal the synchronous engine's, token for token.
"""

import logging

import pytest
import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.core.block_manager import BlockManager
from cbrun.engine.core.cache_spec import CacheSpec
from cbrun.engine.core.plan import SchedulerOutput, StepOutput
from cbrun.engine.core.request import PENDING_TOKEN, Request, RequestStatus
from cbrun.engine.core.scheduler import FIFOScheduler
from cbrun.engine.worker.async_batching import use_async_batching
from tests.model_utils import assert_pool_balanced, hf_greedy, random_llama_dir, random_prompts

VOCAB = 128


def run(prompts, params_for, overlap: bool, **config):
    """Outputs by index, and the engine, with ``overlap_steps`` set as asked."""
    settings = dict(page_size=4, max_batch_tokens=32, max_requests_per_batch=8, num_blocks=200)
    settings.update(config)
    engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), EngineConfig(**settings))
    engine.overlap_steps = overlap
    outputs = {o.request_id: o for o in engine.generate((i, p, params_for(i)) for i, p in enumerate(prompts))}
    assert_pool_balanced(engine)
    return outputs, engine


def tokens(outputs):
    return [outputs[i].output_token_ids for i in range(len(outputs))]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(20, VOCAB, 1, 30, seed=7)


@pytest.fixture(scope="module")
def stop_token(prompts):
    """A token the greedy runs generate often, so stopping on it ends many requests mid-flight."""
    outputs, _ = run(prompts, lambda i: SamplingParams(max_new_tokens=16), overlap=False)
    counts = torch.bincount(torch.tensor([t for o in tokens(outputs) for t in o[1:-1]]), minlength=VOCAB)
    return int(counts.argmax())


def test_overlap_equals_transformers_greedy(prompts):
    outputs, engine = run(prompts, lambda i: SamplingParams(max_new_tokens=10), overlap=True)
    model_dir = random_llama_dir(VOCAB)
    assert tokens(outputs) == [hf_greedy(model_dir, p, 10) for p in prompts]
    assert engine.stats.num_generated_tokens == 10 * len(prompts)


def test_requests_finishing_in_flight_drop_their_extra_token(prompts, stop_token):
    params = lambda i: SamplingParams(max_new_tokens=16 + i, stop_token_ids=[stop_token])  # noqa: E731
    sync, sync_engine = run(prompts, params, overlap=False)
    overlapped, engine = run(prompts, params, overlap=True)
    assert tokens(overlapped) == tokens(sync)
    stopped = [o for o in sync.values() if o.finish_reason == "stop"]
    assert len(stopped) >= 3, "the stop token must end several requests early"
    assert all(overlapped[o.request_id].finish_reason == "stop" for o in stopped)
    # Steps launched for requests already finished are not counted as generated tokens.
    assert engine.stats.num_generated_tokens == sync_engine.stats.num_generated_tokens


def test_sampled_and_processed_requests_match_the_synchronous_run(prompts, stop_token):
    """Seeded sampling, penalties and log-probabilities are drawn on the device at launch and take part in the
    overlap. Outputs equal the synchronous run's."""

    def params(i):
        kind = i % 4
        if kind == 0:
            return SamplingParams(max_new_tokens=12, temperature=0.8, seed=i)
        if kind == 1:
            return SamplingParams(max_new_tokens=12, repetition_penalty=1.3, logprobs=2)
        if kind == 2:
            return SamplingParams(max_new_tokens=12, stop_token_ids=[stop_token], min_new_tokens=3)
        return SamplingParams(max_new_tokens=12, prompt_logprobs_from=1)

    sync, _ = run(prompts, params, overlap=False)
    overlapped, _ = run(prompts, params, overlap=True)
    for i in range(len(prompts)):
        assert overlapped[i].output_token_ids == sync[i].output_token_ids, i
        # Batches differ (prompt rows chunk differently), so floats may differ in the last bits.
        assert_close_logprobs(overlapped[i].logprobs, sync[i].logprobs)
        assert overlapped[i].prompt_logprobs == pytest.approx(sync[i].prompt_logprobs, abs=1e-4)


def assert_close_logprobs(got, want):
    assert (got is None) == (want is None)
    for g, w in zip(got or [], want or [], strict=True):
        assert g.keys() == w.keys() and all(g[t] == pytest.approx(w[t], abs=1e-4) for t in w)


@pytest.mark.parametrize("swap_gib", [0.0, 0.01])
def test_tight_cache_preempting_requests_with_pending_tokens(prompts, swap_gib):
    params = lambda i: SamplingParams(max_new_tokens=12)  # noqa: E731
    unconstrained, _ = run(prompts, params, overlap=False)
    overlapped, engine = run(prompts, params, overlap=True, num_blocks=14, cpu_offload_space=swap_gib)
    assert engine.scheduler.num_soft_resets + engine.scheduler.num_offloads > 0, "the cache must be tight"
    assert tokens(overlapped) == tokens(unconstrained)


def test_prefix_sharing_never_hashes_a_pending_token():
    shared = random_prompts(1, VOCAB, 12, 12, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(6, VOCAB, 1, 6, seed=4)] * 2
    params = lambda i: SamplingParams(max_new_tokens=9)  # noqa: E731
    sync, _ = run(prompts, params, overlap=False, max_requests_per_batch=4)
    overlapped, engine = run(prompts, params, overlap=True, max_requests_per_batch=4)
    assert tokens(overlapped) == tokens(sync)
    bm = engine.block_manager
    assert all(PENDING_TOKEN not in tokens for tokens in bm._block_tokens if tokens is not None)
    assert engine.stats.num_cached_prompt_tokens > 0


def test_generation_stops_at_the_model_length():
    model_dir = random_llama_dir(VOCAB, max_len=32)
    engine = LLMEngine.from_pretrained(str(model_dir), EngineConfig(page_size=4, num_blocks=64))
    engine.overlap_steps = True
    prompts = random_prompts(4, VOCAB, 20, 28, seed=5)
    outputs = list(engine.generate((i, p, SamplingParams(max_new_tokens=50)) for i, p in enumerate(prompts)))
    for o in outputs:
        assert len(o.prompt_token_ids) + len(o.output_token_ids) == 32
        assert o.finish_reason == "length"
    assert_pool_balanced(engine)


def make_scheduler():
    config = EngineConfig(page_size=4, num_blocks=16, max_batch_tokens=64)
    return FIFOScheduler(config, BlockManager(CacheSpec.build(16, 4), True), max_model_len=12)


def launch(scheduler) -> SchedulerOutput:
    plan = scheduler.schedule()
    scheduler.advance(plan)
    return plan


def test_scheduler_runs_a_pending_request_only_when_its_token_can_stay_on_the_device():
    s = make_scheduler()
    greedy = Request("greedy", [1, 2, 3], SamplingParams(max_new_tokens=5))
    sampled = Request("sampled", [1, 2, 3], SamplingParams(max_new_tokens=5, temperature=1.0))
    penalised = Request(
        "penalised", [1, 2, 3], SamplingParams(max_new_tokens=5, temperature=1.0, repetition_penalty=1.2)
    )
    last = Request("last", [1, 2, 3], SamplingParams(max_new_tokens=1))
    at_limit = Request("at_limit", [1] * 11, SamplingParams(max_new_tokens=5))  # 11 + 1 pending = max length
    for r in (greedy, sampled, penalised, last, at_limit):
        s.add_request(r)
    first = launch(s)
    assert all(r.num_pending_tokens == 1 and r.status is RequestStatus.DECODING for r in (greedy, sampled, last))
    assert greedy.token_ids(3, 4) == [PENDING_TOKEN]
    second = s.schedule()  # planned while the first step is in flight
    # Sampled and penalised rows are drawn on the device at launch, like the argmax (a penalised row's counts
    # take its pending token from the device).
    assert [item.request_id for item in second.scheduled] == ["greedy", "sampled", "penalised"]
    s.advance(second)
    finished = s.update_from_output(
        first, StepOutput({r.index: [9] for r in (greedy, sampled, penalised, last, at_limit)})
    )
    assert {r.request_id for r in finished} == {"last", "at_limit"}  # max_new_tokens; the model's length
    assert greedy.output_token_ids == [9] and greedy.num_pending_tokens == 1
    assert sampled.output_token_ids == [9] and sampled.num_pending_tokens == 1
    assert penalised.num_pending_tokens == 1 and penalised.output_token_ids == [9]


def test_model_runner_refuses_a_pending_token_it_cannot_carry():
    engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), EngineConfig(page_size=4, num_blocks=32))
    engine.add_request(0, [1, 2, 3], SamplingParams(max_new_tokens=4))
    plan = engine.scheduler.schedule()
    engine.scheduler.advance(plan)  # launched, but its handle is lost: the next input cannot be carried
    with pytest.raises(RuntimeError, match="did not sample"):
        engine.model_runner.launch(engine.scheduler.schedule(), previous=None)


def test_async_batching_setting_on_the_cpu(caplog):
    model_dir = str(random_llama_dir(VOCAB))
    with pytest.raises(ValueError, match="async_batching = on.*not CUDA"):
        LLMEngine.from_pretrained(model_dir, EngineConfig(num_blocks=16, async_batching="on"))
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        engine = LLMEngine.from_pretrained(model_dir, EngineConfig(num_blocks=16))
    assert engine.overlap_steps is False
    assert "async batching off: the device is cpu" in caplog.text
    with pytest.raises(ValueError, match="async_batching must be one of"):
        EngineConfig(async_batching="yes")


def test_speculation_and_async_batching_are_one_choice(caplog):
    """With a step in flight nothing is known to propose from: the same n-gram workload verifies proposals with
    async batching off and none with it on (the measured reason), so speculation turns "auto" off, saying why."""
    config = EngineConfig(
        page_size=4, num_blocks=200, max_batch_tokens=64, max_requests_per_batch=8, speculative="ngram", ngram_min=1
    )
    prompts = random_prompts(4, VOCAB, 4, 8, seed=3)
    stats = {}
    for overlap in (False, True):
        engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config)
        engine.overlap_steps = overlap
        outputs = list(engine.generate((i, p * 3, SamplingParams(max_new_tokens=24)) for i, p in enumerate(prompts)))
        assert len(outputs) == 4
        stats[overlap] = engine.stats
    assert stats[False].num_verify_steps > 0 and stats[False].num_accepted_tokens > 0
    assert stats[True].num_verify_steps == 0
    assert stats[False].num_steps < stats[True].num_steps
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        assert not use_async_batching("auto", "cuda", True, "ngram")
    assert "async batching off: speculative = 'ngram' proposes from the tokens known on the host" in caplog.text
    assert use_async_batching("auto", "cuda", True, "off")


def test_penalised_rows_run_every_step_with_async_batching(prompts):
    """A penalised row's counts take its pending token from the device, so it decodes every step like a greedy
    one (it used to wait for its token, every other step), with the synchronous run's tokens."""

    def params(i):
        return SamplingParams(max_new_tokens=12, repetition_penalty=1.3, frequency_penalty=0.4, temperature=0.7, seed=i)

    sync, sync_engine = run(prompts[:6], params, overlap=False)
    overlapped, engine = run(prompts[:6], params, overlap=True)
    assert tokens(overlapped) == tokens(sync)
    assert engine.stats.num_steps <= sync_engine.stats.num_steps + 1  # the one step in flight at the end
