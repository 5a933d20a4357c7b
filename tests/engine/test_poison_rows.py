"""Rows that break sampling fail alone (or sample safely); the good rows around them are exactly a clean run's."""

import pytest
import torch

from cbrun.engine import EngineConfig, LLMEngine, SamplingParams
from tests.model_utils import assert_pool_balanced, random_llama_dir, random_prompts

VOCAB = 128
POISON_TOKEN, POISON_POSITION = 5, 6  # a row whose input is this token at this position gets NaN logits


def engine_for(overlap: bool) -> LLMEngine:
    config = EngineConfig(page_size=4, num_blocks=200, max_batch_tokens=32, max_requests_per_batch=8)
    engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config)
    engine.overlap_steps = overlap  # async batching's bookkeeping, run synchronously on the CPU
    return engine


def nan_logits_hook(engine: LLMEngine) -> None:
    """NaN logits for rows whose input is ``POISON_TOKEN`` at ``POISON_POSITION``: a model gone bad for one row."""
    forward = engine.model_runner._forward

    def poisoned(input_ids, positions, md, logits_indices):
        logits = forward(input_ids, positions, md, logits_indices)
        rows = logits_indices[: logits.shape[0]]
        bad = (input_ids[rows] == POISON_TOKEN) & (positions[rows] == POISON_POSITION)
        return logits.masked_fill(bad[:, None], float("nan"))

    engine.model_runner._forward = poisoned


def good_rows():
    """Greedy, host-greedy and seeded sampled rows; prompts longer than POISON_POSITION + 1, so no good row ever
    has a logit row at that position."""
    prompts = random_prompts(8, VOCAB, POISON_POSITION + 2, 30, seed=21)
    kinds = [
        SamplingParams(max_new_tokens=12),
        SamplingParams(max_new_tokens=12, repetition_penalty=1.2),
        SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3),
    ]
    return [(f"good{i}", p, kinds[i % 3]) for i, p in enumerate(prompts)]


def bad_rows():
    """Rows that break a naive sampler, with whether they must fail and the cause their error names."""
    prompt = random_prompts(1, VOCAB, 10, 10, seed=22)[0]
    poisoned = random_prompts(1, VOCAB, POISON_POSITION, POISON_POSITION, seed=23)[0] + [POISON_TOKEN]
    every_token = tuple(range(VOCAB))
    return [
        ("tiny_temperature", prompt, SamplingParams(max_new_tokens=6, temperature=1e-40), None),
        ("huge_temperature", prompt, SamplingParams(max_new_tokens=6, temperature=1e300, seed=1), None),
        ("plus_inf_penalty", prompt, SamplingParams(max_new_tokens=6, frequency_penalty=-1e308, temperature=1.0), None),
        ("minus_inf_penalty", prompt, SamplingParams(max_new_tokens=6, presence_penalty=1e308, temperature=1.0), None),
        (
            "tiny_repetition_penalty",
            prompt,
            SamplingParams(max_new_tokens=6, repetition_penalty=1e-300, temperature=1.0),
            None,
        ),
        ("tiny_top_p_min_p_1", prompt, SamplingParams(max_new_tokens=6, top_p=1e-12, min_p=1.0, temperature=2.0), None),
        ("huge_top_k", prompt, SamplingParams(max_new_tokens=6, top_k=10**9, temperature=1.0), None),
        (
            "nothing_left_sampled",
            prompt,
            SamplingParams(max_new_tokens=6, min_new_tokens=3, stop_token_ids=every_token, temperature=1.0),
            "no token",
        ),
        (
            "nothing_left_greedy",
            prompt,
            SamplingParams(max_new_tokens=6, min_new_tokens=3, stop_token_ids=every_token),
            "no token",
        ),
        ("nan_sampled", poisoned, SamplingParams(max_new_tokens=6, temperature=1.0), "NaN"),
        ("nan_host_greedy", poisoned, SamplingParams(max_new_tokens=6, repetition_penalty=1.1), "NaN"),
    ]


def run(engine, rows) -> dict:
    outputs = {o.request_id: o for o in engine.generate((name, p, params) for name, p, params in rows)}
    assert_pool_balanced(engine)
    return outputs


@pytest.mark.parametrize("overlap", [False, True])
def test_poison_rows_fail_alone_and_good_rows_equal_a_clean_run(overlap):
    good = good_rows()
    clean = run(engine_for(overlap), good)
    engine = engine_for(overlap)
    nan_logits_hook(engine)
    bad = bad_rows()
    mixed = []  # good and bad rows interleaved, so they share steps
    for i in range(max(len(good), len(bad))):
        mixed += good[i : i + 1] + [row[:3] for row in bad[i : i + 1]]
    outputs = run(engine, mixed)
    for name, _, _ in good:
        assert outputs[name].output_token_ids == clean[name].output_token_ids
        assert outputs[name].finish_reason == clean[name].finish_reason
    for name, _, params, cause in bad:
        out = outputs[name]
        if cause is None:
            assert out.finish_reason == "length" and len(out.output_token_ids) == 6, (name, out.error)
        else:
            assert out.finish_reason == "error" and "sampling failed: SamplingError" in out.error, name
            assert cause in out.error, (name, out.error)
    greedy = run(engine_for(overlap), [("t0", bad[0][1], SamplingParams(max_new_tokens=6))])
    assert outputs["tiny_temperature"].output_token_ids == greedy["t0"].output_token_ids  # 1e-40 is greedy


def test_a_row_that_raises_fails_alone_and_device_faults_propagate(monkeypatch):
    """A batched call that raises is redone row by row: only the row that raises alone fails."""
    from cbrun.engine.sample.sampler import SamplingSlots

    real_batch = SamplingSlots.batch
    faults = {"bad": RuntimeError("boom"), "oom": torch.OutOfMemoryError("CUDA out of memory")}

    def batch(self, values, *args):
        for value in values:
            if value.request_id in faults:
                raise faults[value.request_id]
        return real_batch(self, values, *args)

    monkeypatch.setattr(SamplingSlots, "batch", batch)
    sampled = SamplingParams(max_new_tokens=5, temperature=1.0, seed=1)
    prompts = random_prompts(3, VOCAB, 3, 9, seed=24)
    outputs = run(
        engine_for(False),
        [("a", prompts[0], sampled), ("bad", prompts[1], sampled), ("c", prompts[2], SamplingParams(max_new_tokens=5))],
    )
    assert outputs["bad"].finish_reason == "error" and outputs["bad"].error == "sampling failed: RuntimeError: boom"
    assert [outputs[n].finish_reason for n in "ac"] == ["length", "length"]
    engine = engine_for(False)
    with pytest.raises(torch.OutOfMemoryError):
        list(engine.generate([("a", prompts[0], sampled), ("oom", prompts[1], sampled)]))
    assert not engine.has_unfinished_requests()  # the engine is left clean for the job to stop


#: The two overflowing rows of issue 39's bug replay: their scores overflow float32 once the temperature divides
#: them (seen tokens' logits / 1e-38, or output tokens' logits + 1e33 x their count, / 1.5e-5). The sampler shifts
#: each row by its maximum before dividing, so both have a finite distribution, their exact limit.
OVERFLOWING = {
    "repetition_1e-38": SamplingParams(max_new_tokens=20, repetition_penalty=1e-38, temperature=0.7, seed=5),
    "frequency_-1e33": SamplingParams(max_new_tokens=20, frequency_penalty=-1e33, temperature=1.5e-5, seed=6),
}
HEALTHY = {
    "greedy": SamplingParams(max_new_tokens=20),
    "seeded": SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.9, seed=7),
    "penalised": SamplingParams(max_new_tokens=20, repetition_penalty=1.3),
}


def solo(name, prompt, params, overlap):
    return run(engine_for(overlap), [(name, prompt, params)])[name]


@pytest.mark.parametrize("overlap", [False, True])
def test_overflowing_penalties_finish_beside_healthy_rows(overlap):
    """Before the fix the overflowing rows drew id V, the next step's embedding raised IndexError and the whole
    engine stopped; now every row finishes, each exactly as when run alone."""
    prompts = random_prompts(5, VOCAB, 10, 14, seed=31)
    rows = [(name, p, params) for (name, params), p in zip({**OVERFLOWING, **HEALTHY}.items(), prompts)]
    outputs = run(engine_for(overlap), rows)
    for name, prompt, params in rows:
        out = outputs[name]
        assert out.finish_reason == "length" and len(out.output_token_ids) == 20, (name, out.error)
        assert all(0 <= t < VOCAB for t in out.output_token_ids)
        assert out.output_token_ids == solo(name, prompt, params, overlap).output_token_ids, name
    # +1e33 per occurrence at temperature 1.5e-5: the first token wins every later draw.
    frequency = outputs["frequency_-1e33"].output_token_ids
    assert frequency == frequency[:1] * 20
    # seen tokens' positive logits / 1e-38 dwarf every unseen one: each draw repeats a prompt or output token.
    prompt, out = rows[0][1], outputs["repetition_1e-38"].output_token_ids
    assert all(t in prompt + out[:i] for i, t in enumerate(out))


def nan_probabilities_hook(monkeypatch, temperature: float) -> None:
    """NaN probabilities for the sampled rows at ``temperature``: a sampler whose scores overflowed past every guard.
    The inverse-CDF pick then has no finite distribution to draw from."""
    from cbrun.engine.sample import sampler

    real = sampler.sampled_probs

    def poisoned(scores, batch, rows=None, filtered=True, *args, **kwargs):
        probs = real(scores, batch, rows, filtered, *args, **kwargs)
        temps = batch.temperature if rows is None else batch.temperature[rows]
        return probs.masked_fill((temps == temperature)[:, None], float("nan"))

    monkeypatch.setattr(sampler, "sampled_probs", poisoned)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_an_id_outside_the_vocabulary_fails_its_row_alone(monkeypatch, overlap, top_p):
    """Every chosen id is checked on the device before it is committed or fed to the next step: the row whose
    draw has no finite distribution fails, naming the cause; the rest of its batch is exactly a clean run."""
    poison = 0.625  # exactly representable in float32
    prompts = random_prompts(4, VOCAB, 8, 12, seed=32)
    rows = [(name, p, params) for (name, params), p in zip(HEALTHY.items(), prompts)]
    bad = SamplingParams(max_new_tokens=20, temperature=poison, top_p=top_p, seed=8)
    clean = {name: solo(name, prompt, params, overlap) for name, prompt, params in rows}
    nan_probabilities_hook(monkeypatch, poison)
    outputs = run(engine_for(overlap), [("bad", prompts[3], bad), *rows])
    assert outputs["bad"].finish_reason == "error"
    assert "non-finite probabilities" in outputs["bad"].error and "outside the vocabulary" in outputs["bad"].error
    for name, _, _ in rows:
        assert outputs[name].output_token_ids == clean[name].output_token_ids, name
    monkeypatch.undo()  # the rerun, without the fault, finishes
    again = run(engine_for(overlap), [("bad", prompts[3], bad)])
    assert again["bad"].finish_reason == "length" and len(again["bad"].output_token_ids) == 20


def test_inverse_cdf_gives_v_for_a_row_without_a_finite_distribution():
    from cbrun.engine.sample.sampler import inverse_cdf

    weights = torch.tensor([[0.2, 0.8, 0.0], [float("nan")] * 3, [0.0] * 3, [float("inf"), 1.0, 0.0]])
    u = torch.full((4,), 0.5, dtype=torch.float64)
    assert inverse_cdf(weights, u).tolist() == [1, 3, 3, 3]


def test_a_verify_entry_that_raises_at_launch_fails_alone(monkeypatch):
    """Sampled verify entries are verified at launch, all together; when that raises a request fault they are
    verified again when the step is read, each alone where needed: only the entry that raises alone fails, and the
    others commit what a clean run commits."""
    from cbrun.engine.sample import step

    config = EngineConfig(
        page_size=4, num_blocks=200, max_batch_tokens=64, max_requests_per_batch=8, speculative="ngram", ngram_min=1
    )
    sampled = SamplingParams(max_new_tokens=16, temperature=0.3, seed=2)
    prompts = [p * 3 for p in random_prompts(3, VOCAB, 4, 6, seed=25)]  # repeats: the n-gram proposer proposes
    rows = [(name, p, sampled) for name, p in zip(("a", "bad", "c"), prompts)]
    clean = run(LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config), rows)
    real_verify = step.StepSampler._verify_on_device
    calls = {"launch": 0}

    def verify_on_device(self, logits, entries, token_bitmask=None):
        if any(e.values.request_id == "bad" for e in entries):
            calls["launch"] += 1
            raise RuntimeError("boom")
        return real_verify(self, logits, entries, token_bitmask)

    monkeypatch.setattr(step.StepSampler, "_verify_on_device", verify_on_device)
    engine = LLMEngine.from_pretrained(str(random_llama_dir(VOCAB)), config)
    outputs = run(engine, rows)
    assert calls["launch"] and engine.stats.num_verify_steps > 0
    assert outputs["bad"].finish_reason == "error" and "RuntimeError: boom" in outputs["bad"].error
    for name in "ac":
        assert outputs[name].output_token_ids == clean[name].output_token_ids
