"""Scoring inside the memory budget: prompt log-probability rows are scored a chunk at a time (no second copy of
every row's logits), the scheduler plans no more such rows per step than the budget charged, and the budget
charges what a step can produce."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.core import cache_sizing
from cbrun.engine.core.plan import RowSampling, StepOutput
from cbrun.engine.core.request import Request
from cbrun.engine.sample import step
from cbrun.engine.sample.sampler import floats_of
from cbrun.engine.sample.step import StepSampler
from tests.model_utils import random_llama_dir, random_prompts

VOCAB = 128


class PeakBytes(TorchDispatchMode):
    """The most bytes that tensors made inside the mode hold at once (each counted until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(result)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self._seen:  # a view or an in-place result: no new memory
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, key, storage.nbytes())
        return result


def test_prompt_logprobs_are_scored_a_chunk_at_a_time_and_equal_one_pass(monkeypatch):
    rows, vocab = 300, 4000
    monkeypatch.setattr(step, "PROMPT_LOGPROB_CHUNK_BYTES", 64 * 1024)  # 2 rows of float32 copy + log-softmax
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4
    prompt = torch.randint(0, vocab, (rows + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    values = RowSampling.of(Request("r", prompt, SamplingParams(prompt_logprobs_from=1)))
    out = StepOutput()
    sampler = StepSampler(vocab, "cpu", frozenset())
    with PeakBytes() as peak:
        packed = sampler._score_prompts([(values, 0, range(0, rows))], logits)
    sampler._put_prompt_logprobs([(values, 0, range(0, rows))], floats_of(packed.tolist()), out)
    logprobs, greedy = out.prompt_logprobs[values.request_index]
    full = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(prompt[1:])
    assert torch.allclose(torch.tensor(logprobs), full.gather(1, targets[:, None])[:, 0], atol=1e-5)
    assert greedy == (logits.argmax(dim=-1) == targets).tolist()
    one_copy = rows * vocab * 4
    assert peak.peak < one_copy / 10  # the chunks' scratch and (rows,) results, never a (rows, V) tensor


def test_the_scheduler_scores_no_more_rows_per_step_than_the_budget_charges(monkeypatch):
    cap = 5
    monkeypatch.setattr(cache_sizing, "SCORING_LOGITS_BYTES", cap * 4 * VOCAB)
    config = EngineConfig(page_size=4, num_blocks=200, max_batch_tokens=64, max_requests_per_batch=4)
    prompts = random_prompts(3, VOCAB, 20, 30, seed=8)
    params = SamplingParams(max_new_tokens=3, prompt_logprobs_from=1)

    def run(engine):
        launch, scored = engine.model_runner.launch, []

        def recording_launch(plan, *rest):
            scored.append(sum(len(s.prompt_logprob_positions) for s in plan.scheduled))
            return launch(plan, *rest)

        engine.model_runner.launch = recording_launch
        outputs = {o.request_id: o for o in engine.generate((i, p, params) for i, p in enumerate(prompts))}
        return outputs, scored

    capped, scored = run(LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config))
    assert cache_sizing.max_prompt_logprob_rows(config, VOCAB) == cap
    assert max(scored) == cap and sum(scored) == sum(len(p) - 1 for p in prompts)
    monkeypatch.setattr(cache_sizing, "SCORING_LOGITS_BYTES", 2**30)
    free, free_scored = run(LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config))
    assert max(free_scored) > cap
    for i in range(len(prompts)):
        assert capped[i].output_token_ids == free[i].output_token_ids
        assert capped[i].prompt_greedy == free[i].prompt_greedy
        assert torch.allclose(torch.tensor(capped[i].prompt_logprobs), torch.tensor(free[i].prompt_logprobs), atol=1e-4)


def test_the_budget_charges_the_logits_a_scoring_step_can_produce():
    """Issue 39's case: 8,192 batch tokens at a 128k vocabulary could score 8,192 rows (4 GiB of float32 logits)
    while the budget counted 256; now a step scores at most 2,092 rows (1 GiB), and the budget charges them."""
    model = SimpleNamespace(hidden_size=4096, intermediate_size=14336, vocab_size=128256)
    config = EngineConfig(max_batch_tokens=8192, max_requests_per_batch=256)
    rows = cache_sizing.max_prompt_logprob_rows(config, model.vocab_size)
    assert rows == 2**30 // (4 * model.vocab_size) == 2092
    assert cache_sizing.max_logit_rows(config, model.vocab_size) == 256 + rows
    charged = cache_sizing.step_workspace_bytes(config, model)
    assert charged >= (256 + rows) * model.vocab_size * 4 + step.PROMPT_LOGPROB_CHUNK_BYTES
    speculative = EngineConfig(max_batch_tokens=8192, speculative="ngram", num_speculative_tokens=4)
    assert cache_sizing.max_sample_rows(speculative) == speculative.max_requests_per_batch * 5
