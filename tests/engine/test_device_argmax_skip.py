"""The model runner skips the device argmax of a step whose every sampling entry is processed on the host
(``StepInputs.needs_argmax``): outputs are the same as with the argmax forced, and plain greedy entries still
read it."""

from __future__ import annotations

import dataclasses

import pytest

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from tests.model_utils import hf_greedy, random_llama_dir, random_prompts

VOCAB = 128


def _params(i: int) -> SamplingParams:
    if i % 3 == 0:
        return SamplingParams(max_new_tokens=12, temperature=0.9, seed=i)  # sampled at launch
    if i % 3 == 1:
        return SamplingParams(max_new_tokens=12, repetition_penalty=1.3)  # greedy, processed on the host
    return SamplingParams(max_new_tokens=12, top_k=8, temperature=1.2, seed=100 + i, logprobs=2)


def _run(config: EngineConfig, params: list[SamplingParams], force_argmax: bool, overlap: bool = False):
    engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config)
    engine.overlap_steps = overlap
    prepare, seen = engine.model_runner.step_inputs.prepare, []

    def recording_prepare(plan, previous):
        inputs = prepare(plan, previous)
        plain = any(s.samples and not s.needs_host_sampling for s in plan.scheduled)
        seen.append((inputs.needs_argmax, plain))
        return dataclasses.replace(inputs, needs_argmax=True) if force_argmax else inputs

    engine.model_runner.step_inputs.prepare = recording_prepare
    prompts = random_prompts(len(params), VOCAB, 2, 20, seed=5)
    outputs = sorted(
        engine.generate((i, p, q) for i, (p, q) in enumerate(zip(prompts, params))), key=lambda o: o.request_id
    )
    return [(o.output_token_ids, o.logprobs) for o in outputs], seen, prompts


@pytest.mark.parametrize("speculative,overlap", [("off", False), ("off", True), ("ngram", False)])
def test_host_processed_steps_skip_the_argmax_with_the_same_outputs(speculative, overlap):
    """``overlap``: the async path (pending tokens fed from the previous step's device tokens), synchronous on
    the CPU."""
    config = EngineConfig(page_size=4, max_batch_tokens=64, speculative=speculative)
    params = [_params(i) for i in range(9)]
    skipped, seen, _ = _run(config, params, force_argmax=False, overlap=overlap)
    forced, _, _ = _run(config, params, force_argmax=True, overlap=overlap)
    assert skipped == forced
    assert seen and not any(needs for needs, _ in seen)  # every entry of every step is processed on the host


def test_plain_greedy_entries_still_read_the_argmax():
    config = EngineConfig(page_size=4, max_batch_tokens=64)
    params = [SamplingParams(max_new_tokens=10) if i % 2 else _params(i) for i in range(6)]
    outputs, seen, prompts = _run(config, params, force_argmax=False)
    assert all(needs == plain for needs, plain in seen) and sum(plain for _, plain in seen) >= 10
    for i in (1, 3, 5):  # the plain greedy rows are transformers' greedy tokens
        assert outputs[i][0] == hf_greedy(random_llama_dir(VOCAB), prompts[i], 10)
