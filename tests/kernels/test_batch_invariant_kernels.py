"""The batch-invariant Triton kernels (matmul, RMSNorm, log-softmax, attention's invariant tile): each equals its
PyTorch reference (``cbrun.kernels.reference``) within tolerance, and a row's output bits are the same computed
alone or among other rows, in batches of several sizes and at several positions.

Without a GPU the kernels run in Triton's CPU interpreter (``tests.kernels.triton_mode``: set before Triton's
first import; when Triton was imported compiled first, ``test_in_fresh_process`` reruns this file). Shapes
are tiny: the interpreter runs a program per tile in numpy. Outputs start poisoned with NaN.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_mode import DEVICE, IN_PROCESS, in_process, rerun_in_fresh_process

pytest.importorskip("triton")  # after the line above, which sets TRITON_INTERPRET first
from cbrun.kernels import batch_invariant_matmul, log_softmax, paged_attention, rms_norm  # noqa: E402
from cbrun.kernels.reference import log_softmax_ref, matmul_ref, rms_norm_ref  # noqa: E402
from cbrun.kernels.tile_policy import pick_invariant_matmul_tile, pick_row_tile  # noqa: E402


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests run in this process")
def test_in_fresh_process():
    """Reruns this file where TRITON_INTERPRET is set before Triton's first import."""
    rerun_in_fresh_process(__file__, "CBRUN_INVARIANT_KERNEL_TESTS_SUBPROCESS")


TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative to the output scale
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "the kernel left NaN (an element it did not write)"
    scale = expected.float().abs().max().clamp_min(1.0)
    error = (actual.float() - expected.float()).abs().max() / scale
    assert error <= TOLERANCE[dtype], f"max error {float(error):.3g} of scale {float(scale):.3g}"


def _batches(num_rows: int):
    """(start, count) slices of several sizes and positions: alone, pairs, odd counts across a tile boundary."""
    for count in (1, 2, 3, 17, 70):
        for start in (0, num_rows - count, (num_rows - count) // 2):
            if 0 <= start and count <= num_rows:
                yield start, count


# --- matmul ---------------------------------------------------------------------------------------------------


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 40, 24), (37, 70, 130)])  # (M, K, N): K and N off the tile sizes
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_equals_reference(dtype, shape, with_bias):
    m, k, n = shape
    x, weight = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype, seed=1, scale=0.1)
    bias = _rand(n, dtype=dtype, seed=2) if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    result = batch_invariant_matmul.batch_invariant_linear_triton(x, weight, bias, out=out)
    assert result is out
    _close(out, matmul_ref(x, weight, bias), dtype)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_row_bits_do_not_depend_on_the_batch(dtype):
    # 150 rows span two 128-row (16-bit) or three 64-row (float32) tiles: a row is computed at another place in
    # its tile in each slice, and with another number of row tiles in the grid.
    x, weight = _rand(150, 100, dtype=dtype), _rand(72, 100, dtype=dtype, seed=1, scale=0.1)
    bias = _rand(72, dtype=dtype, seed=2)
    full = batch_invariant_matmul.batch_invariant_linear_triton(x, weight, bias)
    for start, count in _batches(x.shape[0]):
        part = batch_invariant_matmul.batch_invariant_linear_triton(x[start : start + count].clone(), weight, bias)
        assert torch.equal(part, full[start : start + count]), (start, count)


def test_matmul_tile_does_not_follow_the_row_count():
    for dtype in DTYPES:
        configs = {batch_invariant_matmul.matmul_launch_config(dtype, True).key()}
        assert len(configs) == 1
        tile = pick_invariant_matmul_tile(dtype.itemsize)
        assert tile.block_k * tile.num_stages * (tile.block_m + tile.block_n) * dtype.itemsize <= 99 * 1024


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (torch.zeros(3, 4), torch.zeros(5, 6), None), "input features"),
        (lambda: (torch.zeros(3, 4), torch.zeros(5, 4, dtype=torch.float16), None), "weight dtype"),
        (lambda: (torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(4)), "bias must be"),
        (lambda: (torch.zeros(4, 3).T, torch.zeros(5, 4), None), "contiguous in its last dim"),
        (lambda: (torch.zeros(3, 4, dtype=torch.int32), torch.zeros(5, 4, dtype=torch.int32), None), "x dtype"),
    ],
)
def test_matmul_rejects_bad_input(make, message):
    x, weight, bias = make()
    with pytest.raises(ValueError, match=message):
        batch_invariant_matmul.batch_invariant_linear_triton(x, weight, bias)


# --- RMSNorm and log-softmax ------------------------------------------------------------------------------------


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 100), (3, 4, 24), (2, 9000)])  # 9000 > MAX_ROW_BLOCK: two loop steps
def test_rms_norm_equals_reference(dtype, shape):
    x, weight = _rand(*shape, dtype=dtype, scale=3.0), _rand(shape[-1], dtype=dtype, seed=1)
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    assert rms_norm.rms_norm_triton(x, weight, 1e-6, out=out) is out
    _close(out, rms_norm_ref(x, weight, 1e-6), dtype)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_row_bits_do_not_depend_on_the_batch(dtype):
    x, weight = _rand(80, 200, dtype=dtype, scale=3.0), _rand(200, dtype=dtype, seed=1)
    full = rms_norm.rms_norm_triton(x, weight, 1e-5)
    for start, count in _batches(x.shape[0]):
        assert torch.equal(
            rms_norm.rms_norm_triton(x[start : start + count].clone(), weight, 1e-5), full[start : start + count]
        )


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_equals_reference(dtype):
    x = _rand(5, 10000, dtype=dtype, scale=4.0)  # 10000 > MAX_ROW_BLOCK: two loop steps
    x[1, :9000] = float("-inf")  # a row whose first step has nothing finite
    out = torch.full(x.shape, float("nan"), device=DEVICE)
    assert log_softmax.log_softmax_triton(x, out=out) is out
    expected = log_softmax_ref(x)
    finite = expected.isfinite()
    assert torch.equal(finite, out.isfinite())
    assert (out[finite] - expected[finite]).abs().max() <= 1e-5 * expected[finite].abs().max().clamp_min(1.0)


@in_process
def test_log_softmax_row_bits_do_not_depend_on_the_batch():
    x = _rand(80, 300, scale=4.0)
    full = log_softmax.log_softmax_triton(x)
    for start, count in _batches(x.shape[0]):
        assert torch.equal(
            log_softmax.log_softmax_triton(x[start : start + count].clone()), full[start : start + count]
        )


def test_row_tile_follows_the_row_length_only():
    assert pick_row_tile(100).block == 128 and pick_row_tile(4096).block == 4096 and pick_row_tile(151936).block == 8192
    assert rms_norm.rms_norm_launch_config(4096).key() == rms_norm.rms_norm_launch_config(4096).key()


def test_row_kernels_reject_bad_input():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm.rms_norm_triton(torch.zeros(3, 8), torch.zeros(4), 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        rms_norm.rms_norm_triton(torch.zeros(8, 3).T, torch.zeros(8), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        log_softmax.log_softmax_triton(torch.zeros(3, 8), out=torch.zeros(3, 8, dtype=torch.float16))


# --- attention: decode and prefill of one token -----------------------------------------------------------------


def _paged(k_len: int, num_kv_heads: int, head_dim: int, page_size: int, dtype, seed=0):
    """One request's context in a paged cache with shuffled pages: (k_cache, v_cache, block_table (1, P))."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-k_len // page_size)
    order = (torch.randperm(pages + 2, generator=gen) + 1)[:pages]
    k_cache = torch.randn(pages + 3, page_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pages + 3, page_size, num_kv_heads, head_dim, generator=gen)
    table = order[None].to(torch.int32)
    return k_cache.to(dtype=dtype, device=DEVICE), v_cache.to(dtype=dtype, device=DEVICE), table.to(DEVICE)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_decode_and_prefill_give_one_token_the_same_bits(dtype):
    # The same token (position p of a 70-token context) attended as a decode (one query row), as the last row of
    # a whole prefill, and as a row in the middle of a chunk: under batch_invariant the KV loop runs the same
    # BLOCK_N steps from position 0 for each, and the positions past p are masked, so the bits agree.
    num_heads, num_kv_heads, head_dim, page_size, k_len = 4, 2, 32, 16, 70
    k_cache, v_cache, table = _paged(k_len, num_kv_heads, head_dim, page_size, dtype)
    query = _rand(k_len, num_heads, head_dim, dtype=dtype, seed=3)

    def run(first: int, last: int) -> torch.Tensor:  # query rows first..last-1, the context up to last
        cu = torch.tensor([0, last - first], dtype=torch.int32, device=DEVICE)
        seqlens = torch.tensor([last], dtype=torch.int32, device=DEVICE)
        return paged_attention.paged_attention_triton(
            query[first:last].clone(), k_cache, v_cache, table, cu, seqlens, 0.17, batch_invariant=True
        )

    prefill = run(0, k_len)
    for p in (0, 15, 16, 41, k_len - 1):
        decode = run(p, p + 1)
        assert torch.equal(decode[0], prefill[p]), p
    chunk = run(30, 55)  # a chunk after 30 cached tokens
    assert torch.equal(chunk, prefill[30:55])


# --- selection -----------------------------------------------------------------------------------------------


def test_selection_names_why_a_device_cannot_run_the_kernels():
    from cbrun.kernels.batch_invariant import triton_invariant_kernels, triton_invariant_unavailable_reason

    assert "dtype torch.int8" in triton_invariant_unavailable_reason("cpu", torch.int8)
    assert "meta" in triton_invariant_unavailable_reason("meta", torch.float32)
    if not torch.cuda.is_available():
        assert "CUDA is not available" in triton_invariant_unavailable_reason("cuda", torch.float16)
    if not IN_PROCESS:
        assert "TRITON_INTERPRET" in triton_invariant_unavailable_reason("cpu", torch.float32)
        with pytest.raises(ValueError, match="cannot run"):
            triton_invariant_kernels("cpu", torch.float32)


@in_process
def test_selection_gives_the_invariant_kernels():
    from cbrun.kernels.batch_invariant import triton_invariant_kernels

    kernels = triton_invariant_kernels(DEVICE, torch.float32)
    assert kernels.name == ("triton-interpreter" if DEVICE == "cpu" else "triton")
    x, weight = _rand(5, 40), _rand(24, 40, seed=1)
    assert torch.equal(kernels.linear(x, weight, None), batch_invariant_matmul.batch_invariant_linear_triton(x, weight))
    assert torch.equal(kernels.rms_norm(x, x[0], 1e-6), rms_norm.rms_norm_triton(x, x[0], 1e-6))
    assert torch.equal(kernels.log_softmax(x), log_softmax.log_softmax_triton(x))
