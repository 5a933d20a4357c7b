"""The sampler reads nothing back from an accelerator where it need not: on a device, a host read of a device value
(``bool(t.any())``, ``.item()``, boolean indexing) makes the host wait for the forward pass queued before the
sampler, and async batching loses its overlap. The CPU stands in for the device (``waits_for_device`` patched on),
with a dispatch mode counting the ops that read back; the tokens are the CPU path's."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cbrun.engine.sample import sampler
from cbrun.engine.sample.sampler import FilterHints, draw_filtered, kth_largest
from cbrun.engine.sampling_params import SamplingParams
from tests.engine.test_sampling_batched import run

VOCAB = 300
READS_BACK = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.nonzero_numpy.default",
    "aten.is_nonzero.default",
}


class CountReadBacks(TorchDispatchMode):
    """Counts the ops that copy a device value to the host (``aten._local_scalar_dense`` and friends)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in READS_BACK:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def as_on_a_device(monkeypatch):
    for module in (sampler,):
        monkeypatch.setattr(module, "waits_for_device", lambda device: True)


def _logits(rows: int, seed: int) -> torch.Tensor:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    logits[1, 5] = float("inf")  # a +inf row takes all the mass
    logits[2, :] = float("-inf")  # nothing left: that row's error
    return logits


PLAIN = [SamplingParams(temperature=0.8, seed=i, logprobs=2 if i % 3 == 0 else None) for i in range(6)]
FILTERED = [
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.1, top_k=7),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01),
    SamplingParams(),  # greedy
    SamplingParams(temperature=1.0),  # no filter, next to filtered rows
]


def test_plain_sampling_reads_nothing_back_and_draws_the_cpu_paths_tokens(monkeypatch):
    logits = _logits(6, seed=1)
    expected = run(logits.clone(), PLAIN)
    for module in (sampler,):
        monkeypatch.setattr(module, "waits_for_device", lambda device: True)
    with CountReadBacks() as counter:
        out = run(logits.clone(), PLAIN, to_host=False)
    assert counter.reads == []
    assert out.to_host() == expected
    tokens, errors, _ = expected
    assert tokens[1] == 5 and "no token is left" in errors[2]  # the +inf and the all -inf rows, settled alike


def test_filtered_sampling_reads_nothing_back_on_a_device(as_on_a_device):
    """On a device the filters draw from the sorted, filtered distribution (``draw_sorted``): no rejection round
    asks the device anything. Its draws are the host's ``filtered_probs`` drawn with the row's first number."""
    logits = _logits(6, seed=2)
    with CountReadBacks() as counter:
        out = run(logits.clone(), FILTERED, to_host=False)
    assert counter.reads == []
    tokens, errors, _ = out.to_host()
    assert "no token is left" in errors[2] and tokens[1] == 5
    for i in (0, 3):  # filtered sampled rows without inf
        p = FILTERED[i]
        probs = torch.softmax(logits[i : i + 1] / p.temperature, dim=1)
        kept = sampler.filtered_probs(probs, torch.tensor([p.top_k]), torch.tensor([p.top_p]), torch.tensor([p.min_p]))
        assert kept[0, tokens[i]] > 0  # the drawn token is in the row's filtered set


def test_sorted_and_rejection_draws_share_one_distribution():
    """``draw_sorted`` (a device's) and ``draw_filtered`` (the CPU's) draw from the same filtered distribution:
    over many draws of one row their frequencies agree."""
    gen = torch.Generator().manual_seed(5)
    row = torch.softmax(torch.randn(1, 40, generator=gen) * 1.5, dim=1)
    n = 4000
    probs = row.repeat(n, 1)
    top_k, top_p, min_p = torch.full((n,), 12), torch.full((n,), 0.8), torch.full((n,), 0.02)
    seeds, positions = torch.arange(n), torch.zeros(n, dtype=torch.int64)
    hints = FilterHints.of([12], [0.8], [0.02], 40)
    sorted_draws = sampler.draw_sorted(probs, top_k, top_p, min_p, seeds, positions, hints)
    rejection_draws = draw_filtered(probs, top_k, top_p, min_p, seeds + n, positions, hints)
    target = sampler.filtered_probs(row, top_k[:1], top_p[:1], min_p[:1])[0]
    for draws in (sorted_draws, rejection_draws):
        freq = torch.bincount(draws, minlength=40).double() / n
        assert (freq[target == 0] == 0).all()
        assert (freq - target.double()).abs().max() < 0.04


def test_hints_give_the_same_bounds_and_tokens():
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(16, VOCAB, generator=gen) * 2, dim=1)
    top_k = torch.tensor([0, 1, 5, 299, 300, 1000, 40, 3] * 2)
    top_p = torch.tensor([1.0, 0.5, 0.9, 1.0] * 4)
    min_p = torch.tensor([0.0] * 8 + [0.1] * 8)
    hints = FilterHints.of(top_k.tolist(), top_p.tolist(), min_p.tolist(), VOCAB)
    assert hints == FilterHints(max_top_k=299, any_top_p=True, any_min_p=True)
    assert torch.equal(kth_largest(probs, top_k, hints.max_top_k), kth_largest(probs, top_k))
    seeds, positions = torch.arange(16) * 7, torch.arange(16)
    assert torch.equal(
        draw_filtered(probs, top_k, top_p, min_p, seeds, positions, hints),
        draw_filtered(probs, top_k, top_p, min_p, seeds, positions),
    )
    assert FilterHints.of([0, 300], [1.0], [0.0], VOCAB) == FilterHints(0, False, False)


def test_a_row_without_top_k_draws_alike_next_to_top_k_rows():
    """The top-p budget of a row without top-k is top_p itself, whatever its neighbours ask for. It was top_p times
    the row's float sum when a neighbour had a top-k: a softmax sums to 1 only up to rounding, so a token at the
    nucleus's edge could be kept alone and rejected next to a top-k row. Here the sum is 0.99 to show it."""
    row = torch.tensor([0.5, 0.2995, 0.1905, 0.0])  # token 2: 0.7995 above it, inside top_p 0.8 but not 0.8 * 0.99
    seeds, positions = torch.arange(64), torch.zeros(64, dtype=torch.int64)
    probs = row.repeat(64, 1)
    alone = draw_filtered(
        probs, torch.zeros(64, dtype=torch.int64), torch.full((64,), 0.8), torch.zeros(64), seeds, positions
    )
    assert (alone == 2).any()
    with_neighbour = draw_filtered(
        torch.cat((probs, row[None])),
        torch.tensor([0] * 64 + [2]),
        torch.tensor([0.8] * 64 + [1.0]),
        torch.zeros(65),
        torch.cat((seeds, torch.tensor([99]))),
        torch.zeros(65, dtype=torch.int64),
    )
    assert torch.equal(with_neighbour[:64], alone)


def test_dense_penalties_on_a_device_equal_the_cpus_sparse_ones(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    scores = torch.randn(5, VOCAB, generator=gen) * 3
    rows = torch.tensor([0, 2, 4])
    counts = torch.randint(0, 3, (4, VOCAB), generator=gen, dtype=torch.int32)
    seen = torch.rand(3, VOCAB, generator=gen) < 0.2
    extra = torch.randint(0, 2, (3, VOCAB), generator=gen, dtype=torch.int32)
    args = (rows, counts, torch.tensor([3, 0, 1]), seen, extra)
    settings = (torch.tensor([1.3, 0.8, 1.0]), torch.tensor([0.5, 0.0, -0.2]), torch.tensor([0.1, 0.7, 0.0]))
    sparse = scores.clone()
    sampler.apply_penalties(sparse, *args, *settings)
    monkeypatch.setattr(sampler, "waits_for_device", lambda device: True)
    dense = scores.clone()
    with CountReadBacks() as counter:
        sampler.apply_penalties(dense, *args, *settings)
    assert counter.reads == [] and torch.equal(dense, sparse) and not torch.equal(dense, scores)
