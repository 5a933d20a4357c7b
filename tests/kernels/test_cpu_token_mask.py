"""The C token-mask kernel against PyTorch oracles: the masked argmax (first index of the largest allowed logit,
NaN and nothing-allowed rows flagged) and the in-place mask (the floats of xgrammar's and of a boolean mask)."""

from __future__ import annotations

import pytest
import torch

from cbrun.engine.sample.sampler import allowed_tokens
from cbrun.engine.structured_output.bitmask import masked_argmax
from cbrun.kernels import c_build, cpu_token_mask
from cbrun.kernels.cpu_token_mask import NAN_ALLOWED, NOTHING_ALLOWED, apply_token_bitmask_cpu, masked_argmax_cpu

pytestmark = pytest.mark.skipif(cpu_token_mask.unavailable_reason() is not None, reason="no C compiler here")


def _oracle_scores(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens at -inf through the unpacked boolean mask (no kernel involved)."""
    return logits.masked_fill(~allowed_tokens(bitmask, logits.shape[1]), float("-inf"))


def _oracle_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> list[int]:
    scores = _oracle_scores(logits, bitmask)
    best = scores.max(dim=1).values
    first = scores.argmax(dim=1)  # torch.argmax: the first index of the maximum
    return [
        NAN_ALLOWED if b.isnan() else NOTHING_ALLOWED if b == float("-inf") else int(t) for b, t in zip(best, first)
    ]


def _case(rows: int, vocab: int, words: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with ties, NaN and -inf, and a bitmask with fully allowed, empty, single-bit and random words."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-4, 5, (rows, vocab), generator=g).float()  # small integers: many ties
    logits[torch.rand(rows, vocab, generator=g) < 0.01] = float("nan")
    logits[torch.rand(rows, vocab, generator=g) < 0.05] = float("-inf")
    logits[0] = float("-inf")
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    kind = torch.randint(0, 4, (rows, words), generator=g)
    bitmask[kind == 0] = -1
    bitmask[kind == 1] = 0
    bitmask[kind == 2] = 1 << 7
    bitmask[1] = 0  # nothing allowed
    bitmask[2] = -1  # everything allowed
    return logits, bitmask


@pytest.mark.parametrize(
    "vocab,words", [(1, 1), (31, 1), (32, 1), (33, 2), (100, 4), (3000, 94), (3000, 90), (70, 5), (32000, 1000)]
)
def test_masked_argmax_equals_the_boolean_mask_oracle(vocab, words):
    for seed in range(3):
        logits, bitmask = _case(24, vocab, words, seed)
        before = logits.clone()
        rows = list(range(24))
        assert masked_argmax_cpu(logits, rows, bitmask) == _oracle_argmax(logits, bitmask)
        assert torch.equal(logits.nan_to_num(), before.nan_to_num())  # nothing written


def test_ties_take_the_first_allowed_index_and_nan_only_counts_where_allowed():
    logits = torch.tensor([[1.0, 5.0, 5.0, 5.0], [float("nan"), 2.0, 2.0, 0.0], [float("nan"), 2.0, 3.0, 0.0]])
    bitmask = torch.tensor([[0b1100], [0b0110], [0b0101]], dtype=torch.int32)
    assert masked_argmax_cpu(logits, [0, 1, 2], bitmask) == [2, 1, NAN_ALLOWED]


def test_rows_mask_rows_strides_and_threads():
    logits, bitmask = _case(40, 3000, 94, seed=7)
    wide = torch.zeros(40, 3100)
    wide[:, 50:3050] = logits[:, :3000]
    view = wide[:, 50:3050]  # row stride 3100, unit inner stride
    rows, mask_rows = [39, 3, 3, 17, 0], [1, 2, 30, 17, 5]
    expected = [_oracle_argmax(logits[r : r + 1], bitmask[m : m + 1])[0] for r, m in zip(rows, mask_rows)]
    for threads in (1, 2, 3):
        assert masked_argmax_cpu(view, rows, bitmask, mask_rows, num_threads=threads) == expected
    assert masked_argmax_cpu(view, [], bitmask) == []


def test_apply_gives_the_floats_of_a_boolean_mask_and_of_xgrammar():
    xgrammar = pytest.importorskip("xgrammar")
    for vocab, words in ((32000, 1000), (33, 2), (100, 3)):
        logits, bitmask = _case(20, vocab, words, seed=vocab)
        ours = logits.clone()
        apply_token_bitmask_cpu(ours, list(range(20)), bitmask)
        assert torch.equal(ours.nan_to_num(), _oracle_scores(logits, bitmask).nan_to_num())
        assert torch.equal(ours.isnan(), _oracle_scores(logits, bitmask).isnan())
        if words * 32 >= vocab:
            theirs = logits.clone()
            xgrammar.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab)
            assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())
    subset = logits.clone()
    apply_token_bitmask_cpu(subset, [3], bitmask, [5])
    assert torch.equal(subset[3].nan_to_num(), _oracle_scores(logits[3:4], bitmask[5:6])[0].nan_to_num())
    assert torch.equal(
        torch.cat((subset[:3], subset[4:])).nan_to_num(), torch.cat((logits[:3], logits[4:])).nan_to_num()
    )


def test_refuses_what_it_does_not_take():
    bitmask = torch.full((2, 1), -1, dtype=torch.int32)
    assert not cpu_token_mask.supports(torch.zeros(2, 32, dtype=torch.bfloat16), bitmask)
    assert not cpu_token_mask.supports(torch.zeros(32, 2).t(), bitmask)  # inner stride 2
    assert not cpu_token_mask.supports(torch.zeros(2, 32), bitmask.to(torch.int64))
    with pytest.raises(ValueError, match="float32 CPU logits"):
        masked_argmax_cpu(torch.zeros(2, 32, dtype=torch.float16), [0], bitmask)
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 2\); got 0..2"):
        masked_argmax_cpu(torch.zeros(2, 32), [0, 2], bitmask)
    with pytest.raises(ValueError, match="2 rows but 1 bitmask rows"):
        apply_token_bitmask_cpu(torch.zeros(2, 32), [0, 1], bitmask, [0])


def test_engine_masked_argmax_is_the_same_with_and_without_the_kernel(monkeypatch):
    logits, bitmask = _case(30, 3000, 94, seed=3)
    rows = [0, 1, 2, 5, 29, 11]
    with_kernel = masked_argmax(logits.clone(), rows, bitmask)
    monkeypatch.setattr(cpu_token_mask, "supports", lambda *_: False)
    assert masked_argmax(logits.clone(), rows, bitmask) == with_kernel
    assert with_kernel == [t if t >= 0 else None for t in _oracle_argmax(logits[rows], bitmask[rows])]


def test_a_failed_build_leaves_the_pytorch_path(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv(c_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpu_token_mask._LIBRARY, "library", None)
    monkeypatch.setattr(cpu_token_mask._LIBRARY, "failure", None)
    assert "cpu_token_mask.c with /bin/false failed" in cpu_token_mask.unavailable_reason()
    logits, bitmask = _case(4, 64, 2, seed=1)
    assert not cpu_token_mask.supports(logits, bitmask)
    assert masked_argmax(logits, [0, 1, 2, 3], bitmask) == [
        t if t >= 0 else None for t in _oracle_argmax(logits, bitmask)
    ]


def test_the_gpu_suites_structured_check_runs_on_the_cpu():
    """``benchmarks.structured_mask.device_check`` (the GPU suite's part) on the CPU: float32 through the C kernel,
    bfloat16 through the PyTorch path, both equal to the C kernel on the same values."""
    from benchmarks.structured_mask import device_check

    calls = []
    rows = device_check("cpu", lambda fn: calls.append(fn()) or 1.5, rows=12, vocab=700)
    assert rows == [("bfloat16", True, True, 1.5), ("float32", True, True, 1.5)] and len(calls) == 2


def test_the_gpu_suites_structured_check_fails_a_wrong_token(monkeypatch):
    from benchmarks.structured_mask import device_check
    from cbrun.engine.structured_output import bitmask as bitmask_module

    real, calls = bitmask_module.masked_argmax, []

    def wrong_on_the_device(logits, rows, bitmask):
        tokens = real(logits, rows, bitmask)
        calls.append(1)
        if len(calls) % 2 == 0:  # each dtype: the CPU's oracle first, then the "device" call
            tokens[1] = next(t for t in range(logits.shape[1]) if not (int(bitmask[1, t // 32]) >> (t % 32)) & 1)
        return tokens

    monkeypatch.setattr(bitmask_module, "masked_argmax", wrong_on_the_device)
    rows = device_check("cpu", lambda fn: 1.0, rows=6, vocab=700)
    assert [(ok, exact) for _, ok, exact, _ in rows] == [(False, False), (False, False)]
