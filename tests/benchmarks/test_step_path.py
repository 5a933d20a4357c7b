"""Issue 39's "at most 5 modules": a step's logits, followed to the scheduler's update, for the row kinds whose
path is longest (``benchmarks.step_path``, the same trace)."""

import pytest

from benchmarks.step_path import KINDS, trace


@pytest.mark.parametrize(("kind", "speculative"), [("sampled + logprobs", "ngram"), ("penalised", "ngram")])
def test_a_steps_logits_reach_the_scheduler_through_at_most_five_modules(kind, speculative):
    path = trace(KINDS[kind], speculative)
    modules = list(dict.fromkeys(path))
    assert "cbrun.engine.spec_decode.speculative_rule" in modules  # the traced step verified proposals
    assert len(modules) <= 5, modules
