"""Chi-square tests of the batched sampler against the exact distribution, in float64, of each filter, the
penalties and the speculative accept/resample rule. Many rows with the same logits and different seeds (and
positions) form one batch, so one call draws the whole sample; the test is deterministic."""

import pytest
import torch

from cbrun.engine.core.plan import RowSampling
from cbrun.engine.core.request import Request
from cbrun.engine.sample.sampler import SamplingRow, TokenCounts, build_batch, sample
from cbrun.engine.sampling_params import SamplingParams
from cbrun.engine.spec_decode.speculative_rule import verify

VOCAB = 12
NUM_DRAWS = 10000
LOGITS = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -1.5, -3.0, 0.9])
PROMPT = [3, 3]
OUTPUT = [1, 1, 2]


def p_value(tokens: list[int], expected: torch.Tensor) -> float:
    from scipy.stats import chisquare

    observed = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    support = expected > 0
    assert observed[~support].sum() == 0, "a token outside the support was drawn"
    if int(support.sum()) == 1:
        return 1.0
    return float(chisquare(observed[support], expected[support] * observed.sum()).pvalue)


def exact(params: SamplingParams) -> torch.Tensor:
    """The target distribution written out plainly in float64 (sorted top-p, as vLLM's and HF's)."""
    scores = LOGITS.double().clone()
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[PROMPT + OUTPUT] = True
    rep = params.repetition_penalty
    scores[seen] = torch.where(scores[seen] > 0, scores[seen] / rep, scores[seen] * rep)
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=VOCAB).double()
    scores -= torch.where(counts > 0, params.frequency_penalty * counts + params.presence_penalty, 0.0)
    probs = torch.softmax(scores / params.temperature, dim=0)
    keep = torch.ones(VOCAB, dtype=torch.bool)
    if params.top_k:
        keep &= probs >= torch.topk(probs, params.top_k).values[-1]
    order = torch.argsort(probs.masked_fill(~keep, 0), descending=True)
    kept = probs.masked_fill(~keep, 0)
    mass_before = torch.cumsum(kept[order], 0) - kept[order]
    drop = mass_before >= params.top_p * kept.sum()
    drop[0] = False
    keep[order[drop]] = False
    keep &= probs >= params.min_p * probs.max()
    target = probs.masked_fill(~keep, 0)
    return target / target.sum()


def batch_of(params: SamplingParams, extra=None):
    rows = []
    for i in range(NUM_DRAWS):
        request = Request(i, list(PROMPT), params, seed=1000 + i)
        request.output_token_ids = list(OUTPUT)
        rows.append(SamplingRow(RowSampling.of(request), list(extra or [])))
    batch = build_batch(rows, TokenCounts(VOCAB, "cpu"), frozenset(), "cpu")
    batch.positions = torch.arange(NUM_DRAWS) % 7 + len(OUTPUT)  # other positions draw other numbers too
    return batch


CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=4),
    "top_p": SamplingParams(temperature=1.0, top_p=0.75),
    "min_p": SamplingParams(temperature=1.2, min_p=0.2),
    "all_filters": SamplingParams(temperature=1.3, top_k=7, top_p=0.9, min_p=0.05),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.3),
    "penalties_and_filters": SamplingParams(temperature=0.8, top_p=0.8, repetition_penalty=0.7, frequency_penalty=-0.2),
}


@pytest.mark.parametrize("name", CASES)
def test_sampled_rows_follow_the_exact_distribution(name):
    params = CASES[name]
    out = sample(LOGITS.expand(NUM_DRAWS, VOCAB), batch_of(params))
    tokens, errors, _ = out.to_host()
    assert set(errors) == {None}
    assert p_value(tokens, exact(params)) > 1e-3, name


def test_min_p_one_keeps_only_the_top_token():
    out = sample(
        LOGITS.expand(64, VOCAB),
        build_batch(
            [
                SamplingRow(RowSampling.of(Request(i, [1], SamplingParams(temperature=5.0, min_p=1.0), seed=i)), [])
                for i in range(64)
            ],
            TokenCounts(VOCAB, "cpu"),
            frozenset(),
            "cpu",
        ),
    )
    assert set(out.tokens.tolist()) == {0}


@pytest.mark.parametrize("name", ["temperature", "all_filters", "penalties_and_filters"])
@pytest.mark.parametrize("proposal", ["point_mass", "draft", "bonus"])
def test_speculative_rule_keeps_the_target_distribution(name, proposal):
    params = CASES[name]
    batch = batch_of(params)
    gen = torch.Generator().manual_seed(5)
    q = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, dim=0)
    if proposal == "draft":  # proposals drawn from q
        proposals = torch.multinomial(q, NUM_DRAWS, replacement=True, generator=gen)
        out = verify(
            LOGITS.expand(NUM_DRAWS, VOCAB),
            batch,
            proposals,
            q.expand(NUM_DRAWS, VOCAB).float(),
            torch.ones(NUM_DRAWS, dtype=torch.bool),
        )
    else:  # a fixed n-gram proposal (the most likely token), or the bonus position
        fixed = int(exact(params).argmax()) if proposal == "point_mass" else -1
        out = verify(LOGITS.expand(NUM_DRAWS, VOCAB), batch, torch.full((NUM_DRAWS,), fixed), None, None)
    tokens, errors, _ = out.sampled.to_host()
    assert set(errors) == {None}
    assert p_value(tokens, exact(params)) > 1e-3
    accepted = out.accepted.tolist()
    assert all(
        t == int(x) for t, x, a in zip(tokens, proposals if proposal == "draft" else [fixed] * NUM_DRAWS, accepted) if a
    )


def test_greedy_verify_rows_accept_only_the_argmax():
    batch = batch_of(SamplingParams(repetition_penalty=1.6))
    proposals = torch.arange(NUM_DRAWS) % VOCAB
    out = verify(LOGITS.expand(NUM_DRAWS, VOCAB), batch, proposals, None, None)
    best = int(exact(SamplingParams(temperature=1.0, repetition_penalty=1.6)).argmax())
    assert set(out.sampled.tokens.tolist()) == {best}
    assert torch.equal(out.accepted, proposals == best)
