"""The C draw of sampled rows (``cbrun/kernels/cpu_sampler.c``) against its PyTorch reference, the sampler's
``draw_filtered`` on torch's softmax: the same tokens on thousands of random rows, each row's token independent of
its batch and of the thread count, and the error codes of rows without a distribution."""

import numpy as np
import pytest
import torch

from cbrun.engine.sample import sampler
from cbrun.kernels import cpu_sampler

pytestmark = pytest.mark.skipif(
    cpu_sampler.unavailable_reason() is not None, reason=f"no CPU sampler kernel: {cpu_sampler.unavailable_reason()}"
)

# (temperature, top_k, top_p, min_p): Llama-3's defaults, plain, each filter alone and together
SETTINGS = [
    (0.6, 0, 0.9, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.8, 40, 1.0, 0.0),
    (1.3, 0, 1.0, 0.1),
    (0.7, 20, 0.5, 0.05),
    (1.0, 5, 0.95, 0.0),
    (2.0, 0, 0.3, 0.0),
]


def settings(rows: int, temperature: float, top_k: int, top_p: float, min_p: float):
    return (
        np.full(rows, temperature, np.float32),
        np.full(rows, top_k, np.int64),
        np.full(rows, top_p, np.float32),
        np.full(rows, min_p, np.float32),
    )


def streams(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Rows' seeds, output positions, and (R, 2) their seed hashes and positions as the kernel takes them."""
    seeds = torch.arange(rows, dtype=torch.int64) + 1000 * seed
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(seed))
    return seeds, positions, np.stack([sampler.mix64(seeds).numpy(), positions.numpy()], axis=1)


def kernel(logits, rows, temperature, top_k, top_p, min_p, stream, **kwargs):
    hashes, positions = np.ascontiguousarray(stream[:, 0]), np.ascontiguousarray(stream[:, 1])
    return cpu_sampler.sample_rows(logits, rows, temperature, top_k, top_p, min_p, hashes, positions, **kwargs)


def reference(logits, temperature, top_k, top_p, min_p, seeds, positions) -> torch.Tensor:
    """The PyTorch sampler's draw of the same rows."""
    shifted = (logits - logits.amax(dim=1, keepdim=True)) / torch.from_numpy(temperature)[:, None]
    probs = torch.softmax(shifted, dim=1)
    tk, tp, mp = (torch.from_numpy(a) for a in (top_k, top_p, min_p))
    return sampler.draw_filtered(probs, tk, tp, mp, seeds, positions)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "t{}-k{}-p{}-m{}".format(*s))
@pytest.mark.parametrize("vocab", [512, 1000])
def test_the_kernel_draws_the_pytorch_samplers_tokens(setting, vocab):
    rows = 1024
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    arrays = settings(rows, *setting)
    seeds, positions, stream = streams(rows)
    drawn = kernel(logits, np.arange(rows), *arrays, stream)
    assert bool(((drawn >= 0) & (drawn < vocab)).all())
    assert torch.equal(drawn, reference(logits, *arrays, seeds, positions))


def test_a_rows_token_is_the_same_alone_in_any_batch_and_with_threads():
    rows, vocab = 300, 777
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)) * 4
    mixed = [SETTINGS[i % len(SETTINGS)] for i in range(rows)]
    arrays = [
        np.array([m[j] for m in mixed], dtype=d) for j, d in enumerate((np.float32, np.int64, np.float32, np.float32))
    ]
    _, _, stream = streams(rows, seed=3)
    together = kernel(logits, None, *arrays, stream)
    threaded = kernel(logits, np.arange(rows), *arrays, stream, num_threads=2)
    assert torch.equal(together, threaded)
    order = np.random.default_rng(0).permutation(rows)
    shuffled = kernel(logits, order, *(a[order] for a in arrays), stream[order])
    assert torch.equal(shuffled, together[torch.from_numpy(order)])
    for i in (0, 17, 299):
        alone = kernel(logits, np.array([i]), *(a[i : i + 1] for a in arrays), stream[i : i + 1])
        assert int(alone[0]) == int(together[i])


def test_an_unfiltered_draw_is_the_inverse_cdf_of_the_streams_number():
    """top_p 1, no top-k or min-p: the first token whose cumulative probability exceeds uniform(seed, position, 0)."""
    vocab = 50
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(2))
    arrays = settings(64, 1.0, 0, 1.0, 0.0)
    seeds, positions, stream = streams(64, seed=9)
    drawn = kernel(logits, np.arange(64), *arrays, stream).tolist()
    probs = torch.softmax(logits.double(), dim=1).numpy()
    for i in range(64):
        u = sampler.reference_uniform(int(seeds[i]), int(positions[i]), sampler.PLAIN)
        assert drawn[i] == int(np.searchsorted(np.cumsum(probs[i]), u * probs[i].sum(), side="right"))


def test_rows_without_a_distribution_get_the_samplers_error_codes():
    vocab = 40
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    logits[0, 7] = float("nan")
    logits[1] = float("-inf")
    logits[2, [3, 30]] = float("inf")  # +inf tokens share the row
    logits[3, :20] = float("-inf")  # ruled-out tokens are never drawn
    temperature, top_k, top_p, min_p = settings(6, 1.0, 0, 0.9, 0.0)
    temperature[4] = float("nan")
    _, _, stream = streams(6)
    drawn = kernel(logits, np.arange(6), temperature, top_k, top_p, min_p, stream).tolist()
    assert drawn[0] == -1 - sampler.NAN_LOGITS
    assert drawn[1] == -1 - sampler.NOTHING_LEFT
    assert drawn[2] in (3, 30)
    assert 20 <= drawn[3] < vocab
    assert drawn[4] == -1 - sampler.OUT_OF_VOCAB
    assert 0 <= drawn[5] < vocab
    assert sampler.decode_error(drawn[4]) == sampler.ERROR_MESSAGES[sampler.OUT_OF_VOCAB]


def test_the_wrapper_refuses_arrays_of_the_wrong_kind():
    logits = torch.zeros(2, 8)
    temperature, top_k, top_p, min_p = settings(2, 1.0, 0, 1.0, 0.0)
    stream = np.zeros((2, 2), np.int64)
    with pytest.raises(ValueError, match="top_k must be"):
        kernel(logits, np.arange(2), temperature, top_k.astype(np.int32), top_p, min_p, stream)
    with pytest.raises(ValueError, match="rows must lie"):
        kernel(logits, np.array([0, 2]), temperature, top_k, top_p, min_p, stream)
    with pytest.raises(ValueError, match="float32 CPU logits"):
        kernel(logits.double(), np.arange(2), temperature, top_k, top_p, min_p, stream)
