"""The batched sampler's units: the random stream, the token bitmask, row independence, failing rows."""

import pytest
import torch

from cbrun.engine.core.plan import RowSampling
from cbrun.engine.core.request import Request
from cbrun.engine.sample import sampler
from cbrun.engine.sample.sampler import SamplingRow, TokenCounts, allowed_tokens, build_batch, sample
from cbrun.engine.sampling_params import SamplingParams

VOCAB = 70  # not a multiple of 32: the bitmask's last word is partial


def rows_of(params_list, seeds=None, outputs=None):
    rows = []
    for i, params in enumerate(params_list):
        request = Request(f"r{i}", [1, 2, 3], params, seed=(seeds or list(range(len(params_list))))[i])
        request.output_token_ids = list((outputs or {}).get(i, []))
        rows.append(SamplingRow(RowSampling.of(request), []))
    return rows


def run(logits, params_list, bitmask=None, seeds=None, outputs=None, to_host=True):
    rows = rows_of(params_list, seeds, outputs)
    batch = build_batch(rows, TokenCounts(logits.shape[1], "cpu"), frozenset(), "cpu")
    out = sample(logits, batch, bitmask)
    return out.to_host() if to_host else out


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """(R, V) bool -> (R, ceil(V / 32)) int32 in xgrammar's layout."""
    words = -(-allowed.shape[1] // 32)
    padded = torch.zeros(allowed.shape[0], words * 32, dtype=torch.int64)
    padded[:, : allowed.shape[1]] = allowed.long()
    weights = 1 << torch.arange(32, dtype=torch.int64)
    packed = (padded.view(allowed.shape[0], words, 32) * weights).sum(dim=2)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_random_stream_matches_its_python_reference():
    seeds = [0, 1, -5, 2**63 + 7, 123456789123, 2**64 - 1]
    keys = torch.tensor([sampler.stream_key(s) for s in seeds])
    positions = torch.tensor([0, 1, 2, 1000, 77, 5])
    got = sampler.uniform(keys, positions, sampler.RESIDUAL).tolist()
    assert got == [sampler.reference_uniform(s, int(p), sampler.RESIDUAL) for s, p in zip(seeds, positions.tolist())]
    assert all(0.0 < u < 1.0 for u in got)


def test_bitmask_unpacks_in_xgrammars_layout():
    allowed = torch.rand(3, VOCAB, generator=torch.Generator().manual_seed(0)) < 0.3
    assert torch.equal(allowed_tokens(pack(allowed), VOCAB), allowed)
    word = torch.tensor([[-(2**31), 1, 0]], dtype=torch.int32)  # bit 31 of word 0, bit 0 of word 1
    assert allowed_tokens(word, VOCAB)[0].nonzero()[:, 0].tolist() == [31, 32]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.5, logprobs=3),
    ],
)
def test_token_bitmask_restricts_every_row_to_its_allowed_tokens(params):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    allowed = torch.rand(6, VOCAB, generator=gen) < 0.2
    allowed[:, 5] = True
    allowed[2] = True  # an unconstrained row: every bit set
    for trial in range(20):
        tokens, errors, _ = run(logits, [params] * 6, pack(allowed), seeds=[trial * 6 + i for i in range(6)])
        assert errors == [None] * 6
        assert all(allowed[i, t] for i, t in enumerate(tokens))
    if params.greedy:  # the argmax over the allowed tokens
        assert tokens == logits.masked_fill(~allowed, float("-inf")).argmax(dim=1).tolist()
    unconstrained = run(logits, [params] * 6, None, seeds=[19 * 6 + i for i in range(6)])[0]
    assert tokens[2] == unconstrained[2]  # all bits set is the same as no mask


def test_bitmask_ruling_out_everything_fails_that_row_alone():
    logits = torch.randn(2, VOCAB)
    allowed = torch.ones(2, VOCAB, dtype=torch.bool)
    allowed[1] = False
    _, errors, _ = run(logits, [SamplingParams(temperature=1.0)] * 2, pack(allowed))
    assert errors[0] is None and "no token is left" in errors[1]


def test_nan_row_fails_alone_and_inf_takes_all_the_mass():
    logits = torch.randn(3, VOCAB)
    logits[0, 4] = float("nan")
    logits[1, 9] = float("inf")
    tokens, errors, logprobs = run(logits, [SamplingParams(temperature=1.0, logprobs=1)] * 3)
    assert "NaN" in errors[0] and errors[1:] == [None, None]
    assert tokens[1] == 9 and logprobs[1][9] == 0.0


def test_rows_do_not_depend_on_their_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, VOCAB, generator=gen)
    kinds = [
        SamplingParams(temperature=0.9, top_p=0.8, seed=1),
        SamplingParams(),
        SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.2, seed=2),
        SamplingParams(temperature=1.0, top_k=5, logprobs=2, seed=3),
    ]
    params = [kinds[i % 4] for i in range(8)]
    outputs = {i: [i, 7, 7] for i in range(8)}
    together = run(logits, params, seeds=list(range(8)), outputs=outputs)
    for i in range(8):
        alone = run(logits[i : i + 1], [params[i]], seeds=[i], outputs={0: outputs[i]})
        assert (alone[0][0], alone[2][0]) == (together[0][i], together[2][i])


def test_token_counts_follow_the_output_and_a_released_row_starts_clean():
    counts = TokenCounts(VOCAB, "cpu")
    first = Request("a", [3, 4], SamplingParams(repetition_penalty=1.2))
    first.output_token_ids = [5, 5]
    rows, seen, extra = counts.gather([RowSampling.of(first)] * 2, [[], [6, 5]])
    assert seen[:, [3, 4, 5]].all() and seen[:, 6].tolist() == [False, True]
    assert counts.counts[rows[0], 5] == 2 and extra[1, 5] == 1 and extra[0].sum() == 0
    first.output_token_ids.append(7)  # the next step counts only the new token
    rows, seen, _ = counts.gather([RowSampling.of(first)], [[]])
    assert counts.counts[rows[0], 5] == 2 and counts.counts[rows[0], 7] == 1
    counts.release(first.index)
    second = Request("b", [9], SamplingParams(repetition_penalty=1.2))
    rows, seen, _ = counts.gather([RowSampling.of(second)], [[]])  # reuses the freed row
    assert seen[0].nonzero()[:, 0].tolist() == [9] and counts.counts[rows[0]].sum() == 0
