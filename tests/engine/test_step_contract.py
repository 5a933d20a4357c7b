"""The step's contract (issue 39), each held by a run of the engine: every ``Request`` field has one writer, the row
predicates are evaluated once per request (then read from the batch's sampling metadata), the logit-row layout is
computed once per plan, and overflowing rows fail alone or finish on the CPU's and a device's sampler paths."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict

import pytest
import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from cbrun.engine.core import plan as plan_module
from cbrun.engine.core.request import Request
from cbrun.engine.sample import sampler, step
from tests.model_utils import assert_pool_balanced, random_llama_dir, random_prompts

VOCAB = 128
#: The one module that writes each field (everything else: the scheduler). The block manager owns the tables,
#: the speculator its own state, and the engine builds a constrained request's grammar state before queueing it.
WRITERS = {
    "block_table": "cbrun.engine.core.block_manager",
    "sliding_block_table": "cbrun.engine.core.block_manager",
    "cpu_pages": "cbrun.engine.core.block_manager",
    "speculation": "cbrun.engine.spec_decode.speculative",
    "structured": "cbrun.engine.llm_engine",
}
KINDS = [
    SamplingParams(max_new_tokens=14),
    SamplingParams(max_new_tokens=14, temperature=0.6, top_p=0.9, seed=1),
    SamplingParams(max_new_tokens=14, temperature=0.8, repetition_penalty=1.2, logprobs=2, seed=2),
    SamplingParams(max_new_tokens=14, prompt_logprobs_from=1, min_new_tokens=4, temperature=0.7, seed=3),
]


def _writer() -> str:
    return sys._getframe(3).f_globals.get("__name__", "?")  # past _record and the list method


class _TrackedList(list):
    """A request's list field that records which module changes it."""

    def __init__(self, values, name: str, writers: dict) -> None:
        super().__init__(values)
        self.name, self.writers = name, writers

    def _record(self) -> None:
        self.writers[self.name].add(_writer())


for _method in ("append", "extend", "insert", "pop", "remove", "clear", "sort", "__setitem__", "__delitem__"):

    def _tracked(self, *args, _method=_method):
        self._record()
        return getattr(list, _method)(self, *args)

    setattr(_TrackedList, _method, _tracked)


def _iadd(self, values):
    self._record()
    return list.__iadd__(self, values)


_TrackedList.__iadd__ = _iadd


def run(config: EngineConfig, rows, overlap: bool = False) -> dict:
    engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config)
    engine.overlap_steps = overlap
    outputs = {o.request_id: o for o in engine.generate(rows)}
    assert_pool_balanced(engine)
    return outputs


def rows(n: int, max_new_tokens: int | None = None):
    prompts = random_prompts(n, VOCAB, 6, 20, seed=41)
    out = []
    for i, prompt in enumerate(prompts):
        params = KINDS[i % len(KINDS)]
        if max_new_tokens is not None:
            params = params.replace(max_new_tokens=max_new_tokens)
        out.append((i, prompt, params))
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_every_request_field_has_one_writer(monkeypatch, overlap):
    """Greedy, sampled, penalised rows with log-probabilities and prompt scores, a cache so small that requests are
    preempted, and n-gram speculation: each field of ``Request`` is changed by one module only."""
    writers: dict[str, set[str]] = defaultdict(set)

    def tracking_setattr(self, name, value):
        module = sys._getframe(1).f_globals.get("__name__", "?")
        if module != "cbrun.engine.core.request":  # the constructor
            writers[name].add(module)
        if isinstance(value, list) and not isinstance(value, _TrackedList):
            value = _TrackedList(value, name, writers)
        object.__setattr__(self, name, value)

    monkeypatch.setattr(Request, "__setattr__", tracking_setattr)
    small = EngineConfig(page_size=4, num_blocks=24, max_batch_tokens=32, max_requests_per_batch=8)
    outputs = run(small, rows(12), overlap)
    assert all(o.finish_reason == "length" for o in outputs.values())
    ngram = EngineConfig(page_size=4, num_blocks=200, max_batch_tokens=64, speculative="ngram", ngram_min=1)
    repeats = [
        (i, p * 3, KINDS[i % 2].replace(max_new_tokens=16)) for i, p in enumerate(random_prompts(4, VOCAB, 4, 6))
    ]
    run(ngram, repeats)
    assert {"output_token_ids", "status", "num_computed_tokens", "block_table", "logprobs"} <= set(writers)
    for name, modules in writers.items():
        assert modules == {WRITERS.get(name, "cbrun.engine.core.scheduler")}, (name, modules)


def test_row_predicates_are_evaluated_once_per_request(monkeypatch):
    """``greedy``, ``penalised``, ``filtered``, ``needs_processing`` and ``masked_greedy`` are evaluated when a
    request is accepted and when it is first sampled, not per step: the counts do not grow with the output."""
    counts: Counter = Counter()
    for name in ("greedy", "penalised", "filtered", "needs_processing", "masked_greedy"):
        getter = getattr(SamplingParams, name).fget
        monkeypatch.setattr(
            SamplingParams, name, property(lambda self, g=getter, n=name: counts.update([n]) or g(self))
        )
    config = EngineConfig(page_size=4, num_blocks=200, max_batch_tokens=64, max_requests_per_batch=8)
    per_run = []
    for max_new_tokens in (3, 30):
        counts.clear()
        run(config, rows(8, max_new_tokens))
        per_run.append(dict(counts))
    assert per_run[0] == per_run[1] and per_run[0]["penalised"] > 0, per_run


def test_the_logit_row_layout_is_computed_once_per_plan(monkeypatch):
    computed, planned = [], []
    real_of, real_layout = plan_module.RowLayout.of, plan_module.SchedulerOutput.layout.fget

    def counting_of(scheduled):
        computed.append(1)
        return real_of(scheduled)

    def counting_layout(self):
        if all(p is not self for p in planned):
            planned.append(self)
        return real_layout(self)

    monkeypatch.setattr(plan_module.RowLayout, "of", staticmethod(counting_of))
    monkeypatch.setattr(plan_module.SchedulerOutput, "layout", property(counting_layout))
    config = EngineConfig(page_size=4, num_blocks=200, max_batch_tokens=64, max_requests_per_batch=8)
    run(config, rows(8))
    assert planned and len(computed) == len(planned)


#: Issue 39's bug replay: scores that overflow float32 (seen tokens' logits / 1e-38; output tokens' logits + 1e33
#: per occurrence, then / 1.5e-5), greedy and sampled.
OVERFLOWING = {
    "repetition_greedy": SamplingParams(max_new_tokens=10, repetition_penalty=1e-38),
    "repetition_sampled": SamplingParams(max_new_tokens=10, repetition_penalty=1e-38, temperature=1.5e-5, seed=5),
    "frequency_greedy": SamplingParams(max_new_tokens=10, frequency_penalty=-1e33),
    "frequency_sampled": SamplingParams(max_new_tokens=10, frequency_penalty=-1e33, temperature=1.5e-5, seed=6),
}
HEALTHY = {
    "greedy": SamplingParams(max_new_tokens=10),
    "seeded": SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=7),
}


@pytest.mark.parametrize("device_path", [False, True])
def test_overflowing_rows_finish_alone_or_beside_others_on_either_sampler_path(monkeypatch, device_path):
    """Each overflowing row, alone and in a batch with the others and healthy rows, on the CPU's sampler and on its
    device path (branch-free ops, the sorted draw, dense penalties): every row finishes with ids inside the
    vocabulary, the same in the batch as alone (an error would have to name the row's cause)."""
    if device_path:
        for module in (sampler, step):
            monkeypatch.setattr(module, "waits_for_device", lambda device: True)
    config = EngineConfig(page_size=4, num_blocks=200, max_batch_tokens=64, max_requests_per_batch=8)
    prompts = random_prompts(len(OVERFLOWING) + len(HEALTHY), VOCAB, 8, 14, seed=42)
    all_rows = [(name, p, params) for (name, params), p in zip({**OVERFLOWING, **HEALTHY}.items(), prompts)]
    together = run(config, all_rows, overlap=device_path)
    for row in all_rows:
        alone = run(config, [row], overlap=device_path)[row[0]]
        out = together[row[0]]
        assert out.error is None and out.finish_reason == "length", (row[0], out.error)
        assert all(0 <= t < VOCAB for t in out.output_token_ids)
        assert out.output_token_ids == alone.output_token_ids, row[0]
    # +1e33 per occurrence: the first output token wins every later step, greedy or at temperature 1.5e-5.
    for name in ("frequency_greedy", "frequency_sampled"):
        tokens = together[name].output_token_ids
        assert tokens == tokens[:1] * 10, name


def test_the_cpus_filtered_draws_are_those_of_sampler_version_2():
    """``draw_filtered``'s tokens, pinned: the draws of ``SAMPLER_VERSION`` 2 (as drawn before the sampler was
    merged into one module and its rounds trimmed), which a job's fingerprint records. A change here must bump it."""
    from cbrun.engine.config import SAMPLER_VERSION

    g = torch.Generator().manual_seed(123)
    rows, vocab = 24, 64
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 1.5, 1)
    top_k = torch.tensor([0, 5, 20, 0] * 6)
    top_p = torch.tensor([0.9, 1.0, 0.7, 0.95] * 6)
    min_p = torch.tensor([0.0, 0.0, 0.02, 0.05] * 6)
    seeds, positions = torch.arange(rows) * 7919 + 11, torch.arange(rows) % 5
    mixed = sampler.draw_filtered(probs, top_k, top_p, min_p, seeds, positions)
    nucleus = sampler.draw_filtered(
        probs, torch.zeros(rows, dtype=torch.int64), torch.full((rows,), 0.9), torch.zeros(rows), seeds, positions
    )
    assert SAMPLER_VERSION == 2
    assert mixed.tolist() == [
        20,
        61,
        33,
        8,
        1,
        26,
        30,
        56,
        54,
        20,
        45,
        25,
        34,
        39,
        51,
        3,
        58,
        19,
        49,
        48,
        45,
        48,
        29,
        0,
    ]
    assert nucleus.tolist() == [
        20,
        61,
        7,
        8,
        1,
        8,
        30,
        56,
        54,
        20,
        45,
        25,
        34,
        30,
        51,
        3,
        58,
        19,
        49,
        48,
        45,
        48,
        29,
        0,
    ]
