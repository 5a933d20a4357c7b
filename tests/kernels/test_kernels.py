"""Triton kernels against the PyTorch reference (``cbrun.kernels.reference``) over a pruned parameter grid.

Without a GPU the kernels run in Triton's CPU interpreter (``tests.kernels.triton_mode``: set before Triton's first
import; when Triton was imported compiled first, ``test_kernels_in_fresh_process`` reruns this file). With a GPU
the kernels run compiled on it.

Outputs and caches start poisoned with NaN, so an element the kernel fails to write, or a masked element it
reads, fails the comparison.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.kernels.triton_mode import DEVICE, IN_PROCESS, in_process, rerun_in_fresh_process

pytest.importorskip("triton")  # after the line above, which sets TRITON_INTERPRET first
from cbrun.kernels import kv_cache_write, paged_attention  # noqa: E402
from cbrun.kernels.reference import build_gather_plan, paged_attention_ref, write_kv_cache_ref  # noqa: E402


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests run in this process")
def test_kernels_in_fresh_process():
    """Re-runs this file where TRITON_INTERPRET is set before Triton's first import."""
    rerun_in_fresh_process(__file__, "CBRUN_KERNEL_TESTS_SUBPROCESS")


TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # atol = rtol, by dtype

# name -> (query lengths, context lengths incl. this step): decodes have q_len 1, prefill chunks q_len == k_len,
# a chunk continuing after cached context q_len < k_len. Contexts > 64 take several KV tiles (online softmax).
BATCH_MIXES = {
    "decode": ([1, 1, 1, 1], [1, 17, 70, 150]),
    "prefill": ([7, 33], [7, 33]),
    "mixed": ([1, 20, 1], [90, 20, 5]),
    "chunk": ([24, 1], [130, 40]),
    "long_chunk": ([1, 70], [9, 75]),
    "empty_request": ([3, 0, 1], [3, 10, 12]),
}


def make_batch(q_lens, k_lens, num_heads, num_kv_heads, head_dim, page_size, dtype, index_dtype=torch.int32, seed=0):
    """Random query and paged cache; pages shuffled; every cache slot outside a request's context is NaN.

    Block 0 stays finite and unowned (the reference points masked positions at slot 0); the spare last block is
    NaN and fills the block-table padding, so a kernel reading past a request's pages fails.
    """
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-k // page_size) for k in k_lens]
    num_blocks = sum(pages) + 3
    order = (torch.randperm(num_blocks - 2, generator=gen) + 1).tolist()  # ids 1 .. num_blocks - 2
    block_tables = torch.full((len(q_lens), max(max(pages), 1)), num_blocks - 1, dtype=index_dtype)
    k_cache = torch.full((num_blocks, page_size, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    k_cache[0], v_cache[0] = (torch.randn(page_size, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    for b, (n_pages, k_len) in enumerate(zip(pages, k_lens)):
        ids = [order.pop() for _ in range(n_pages)]
        block_tables[b, :n_pages] = torch.tensor(ids, dtype=index_dtype)
        for pos in range(k_len):
            block, offset = ids[pos // page_size], pos % page_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=index_dtype)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    to = dict(device=DEVICE)
    return (
        query.to(dtype=dtype, **to),
        k_cache.to(dtype=dtype, **to),
        v_cache.to(dtype=dtype, **to),
        block_tables.to(**to),
        cu_seqlens_q.to(**to),
        torch.tensor(k_lens, dtype=index_dtype, device=DEVICE),
    )


def finite(cache: torch.Tensor) -> torch.Tensor:
    """The reference gathers whole pages, so the poison in unused slots must be finite for it (the engine's cache
    always is); the kernel still sees the NaN-poisoned cache and must never read those slots."""
    return cache.nan_to_num(0.0)


def check_attention(
    q_lens,
    k_lens,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    page_size=16,
    dtype=torch.float32,
    sliding_window=None,
    softcap=None,
    index_dtype=torch.int32,
    sinks=None,
):
    query, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k = make_batch(
        q_lens, k_lens, num_heads, num_kv_heads, head_dim, page_size, dtype, index_dtype
    )
    scale = head_dim**-0.5
    plan = build_gather_plan(block_tables, cu_seqlens_q, seqlens_k, page_size, sliding_window)
    expected = paged_attention_ref(query, finite(k_cache), finite(v_cache), plan, scale, softcap, sinks=sinks)
    out = torch.full_like(query, float("nan"))
    result = paged_attention.paged_attention_triton(
        query,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seqlens_k,
        scale,
        sliding_window=sliding_window,
        softcap=softcap,
        max_seqlen_q=max(q_lens),
        out=out,
        sinks=None if sinks is None else sinks.to(DEVICE),
    )
    assert result is out
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mix", list(BATCH_MIXES))
def test_attention_batch_mixes(mix, dtype):
    check_attention(*BATCH_MIXES[mix], dtype=dtype)


@in_process
@pytest.mark.parametrize("capability", [80, 89, 90])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_attention_tiles_of_each_architecture(capability, dtype, head_dim, monkeypatch):
    """The tiles ``cbrun.kernels.tile_policy`` picks for each GPU part (decode and prefill rows, BLOCK_N 32 or 64)
    compute the reference's attention: the batch mixes a long chunk (several KV tiles) with a decode."""
    monkeypatch.setattr(paged_attention, "device_capability", lambda device: capability)
    check_attention([24, 1], [130, 40], head_dim=head_dim, dtype=dtype)
    check_attention([1, 1], [70, 9], head_dim=head_dim, dtype=dtype)


@in_process
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 96])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (4, 1), (6, 2)])
def test_attention_shapes(num_heads, num_kv_heads, head_dim, page_size):
    check_attention([1, 9, 1], [37, 12, 70], num_heads, num_kv_heads, head_dim, page_size)


@in_process
@pytest.mark.parametrize("sliding_window,softcap", [(8, None), (None, 30.0), (8, 30.0)])
@pytest.mark.parametrize("mix", ["decode", "mixed", "chunk"])
def test_attention_window_and_softcap(mix, sliding_window, softcap):
    check_attention(*BATCH_MIXES[mix], sliding_window=sliding_window, softcap=softcap)


@in_process
@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sliding_window", [None, 8])
def test_attention_sinks(dtype, sliding_window):
    """Attention sinks (gpt-oss): one logit per query head in the softmax denominator, well above and below the
    scores (GQA group of 4, so each program's rows hold several heads' sinks)."""
    sinks = torch.linspace(-3.0, 5.0, 8)
    check_attention(*BATCH_MIXES["mixed"], dtype=dtype, sliding_window=sliding_window, sinks=sinks)


def test_attention_softcap_low_precision_and_int64_indices():
    check_attention(
        *BATCH_MIXES["mixed"], dtype=torch.bfloat16, sliding_window=5, softcap=30.0, index_dtype=torch.int64
    )


@in_process
def test_attention_head_dim_40_page_4():
    check_attention(*BATCH_MIXES["chunk"], num_heads=4, num_kv_heads=1, head_dim=40, page_size=4)


@in_process
def test_attention_strided_query_and_padding_rows():
    """Query as a slice of a fused QKV tensor; rows past cu_seqlens_q[-1] (graph padding) stay untouched."""
    q_lens, k_lens = BATCH_MIXES["mixed"]
    query, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k = make_batch(
        q_lens, k_lens, 4, 2, 64, 16, torch.float32
    )
    num_tokens, padded = query.shape[0], query.shape[0] + 3
    fused = torch.randn(padded, 4 + 2 * 2, 64, device=DEVICE)  # (T, H + 2 * Hkv, D): q | k | v
    fused[:num_tokens, :4] = query
    strided_query = fused[:, :4]
    plan = build_gather_plan(block_tables, cu_seqlens_q, seqlens_k, 16)
    expected = paged_attention_ref(query, finite(k_cache), finite(v_cache), plan, 0.125)
    out = paged_attention.paged_attention_triton(
        strided_query,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seqlens_k,
        0.125,
        out=torch.full_like(strided_query, float("nan")),
    )
    torch.testing.assert_close(out[:num_tokens], expected, atol=1e-4, rtol=1e-4)
    assert out[num_tokens:].isnan().all()


@in_process
def test_attention_max_seqlen_q_defaults_from_cu_seqlens():
    query, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k = make_batch(
        [1, 5], [9, 5], 4, 2, 64, 16, torch.float32
    )
    plan = build_gather_plan(block_tables, cu_seqlens_q, seqlens_k, 16)
    out = paged_attention.paged_attention_triton(query, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, 0.1)
    torch.testing.assert_close(
        out, paged_attention_ref(query, finite(k_cache), finite(v_cache), plan, 0.1), atol=1e-4, rtol=1e-4
    )


def _attention_args(**overrides):
    args = dict(
        zip(
            ("query", "k_cache", "v_cache", "block_tables", "cu_seqlens_q", "seqlens_k"),
            make_batch([1, 3], [4, 3], 4, 2, 64, 4, torch.float32),
        )
    )
    args["scale"] = 0.125
    args.update(overrides)
    return args


@in_process
@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            dict(query=torch.zeros(4, 4, 512), k_cache=torch.zeros(3, 4, 2, 512), v_cache=torch.zeros(3, 4, 2, 512)),
            "head_dim 512 is not supported",
        ),
        (dict(query=torch.zeros(4, 3, 64)), "multiple of num_kv_heads"),
        (dict(query=torch.zeros(4, 4, 64, dtype=torch.float16)), "differs from query dtype"),
        (dict(query=torch.zeros(4, 4, 128)[..., ::2]), "contiguous in its last dim"),
        (dict(seqlens_k=torch.zeros(2)), "seqlens_k dtype must be int32 or int64"),
        (dict(cu_seqlens_q=torch.zeros(2, dtype=torch.int32)), "B + 1 = 3 entries"),
        (dict(block_tables=torch.zeros(3, 2, dtype=torch.int32)), "block_tables must be (B=2"),
        (dict(sliding_window=0), "sliding_window must be a positive int"),
        (dict(softcap=-1.0), "softcap must be > 0"),
    ],
)
def test_attention_rejects_bad_input(overrides, message):
    args = _attention_args()
    overrides = {k: v.to(args["query"].device) if isinstance(v, torch.Tensor) else v for k, v in overrides.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention.paged_attention_triton(**{**args, **overrides})


def make_kv_write(num_tokens, num_kv_heads, head_dim, page_size, dtype, slot_dtype, seed=0):
    """Keys/values (as strided slices of a fused tensor), NaN caches, and a slot mapping with padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // page_size) + 2
    fused = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    slots = torch.randperm(num_blocks * page_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1
    k_cache = torch.full((num_blocks, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    return key, value, k_cache, k_cache.clone(), slots.to(dtype=slot_dtype, device=DEVICE)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "num_kv_heads,head_dim,page_size,slot_dtype",
    [
        (1, 64, 16, torch.int64),
        (2, 128, 4, torch.int32),
        (4, 80, 16, torch.int64),
        (3, 40, 4, torch.int32),
    ],
)
def test_kv_cache_write(num_kv_heads, head_dim, page_size, slot_dtype, dtype):
    key, value, k_cache, v_cache, slots = make_kv_write(23, num_kv_heads, head_dim, page_size, dtype, slot_dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, k_expected, v_expected, slots)
    kv_cache_write.write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    # Exact copy, and every slot the mapping skips is still NaN in both.
    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0, equal_nan=True)


@in_process
@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(slot_mapping=torch.zeros(5, dtype=torch.int64)), "slot_mapping must be (4,)"),
        (dict(slot_mapping=torch.zeros(4)), "slot_mapping dtype must be int32 or int64"),
        (dict(value=torch.zeros(4, 2, 64, dtype=torch.float16)), "value dtype"),
        (dict(k_cache=torch.zeros(3, 4, 2, 32), v_cache=torch.zeros(3, 4, 2, 32)), "does not match key"),
        (dict(key=torch.zeros(4, 2, 128)[..., ::2]), "contiguous in its last dim"),
    ],
)
def test_kv_cache_write_rejects_bad_input(overrides, message):
    args = dict(
        key=torch.zeros(4, 2, 64),
        value=torch.zeros(4, 2, 64),
        k_cache=torch.zeros(3, 4, 2, 64),
        v_cache=torch.zeros(3, 4, 2, 64),
        slot_mapping=torch.arange(4),
    )
    args = {k: v.to(DEVICE) for k, v in {**args, **overrides}.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        kv_cache_write.write_kv_cache_triton(**args)


def test_batch_invariant_launch_is_one_tile_that_the_ahead_of_time_check_compiles():
    # batch_invariant launches one tile whatever the batch's longest query: the prefill tile, which
    # cbrun.kernels.aot_fit compiles (and checks for shared memory and spills) for sm_80, sm_89 and sm_90.
    from cbrun.kernels import aot_fit

    assert paged_attention.INVARIANT_MAX_SEQLEN_Q in aot_fit.MAX_SEQLEN_Q
    assert paged_attention.INVARIANT_MAX_SEQLEN_Q in aot_fit.SUBSET["max_seqlen_qs"]
    for capability in aot_fit.CAPABILITIES:
        compiled = {launch.config.key() for launch in aot_fit.engine_launches(capability, kv_write=False)}
        for model in aot_fit.MODELS:
            for dtype in aot_fit.DTYPES:
                invariant = paged_attention.attention_launch_config(
                    dtype,
                    model.num_heads,
                    model.num_kv_heads,
                    model.head_dim,
                    16,
                    paged_attention.INVARIANT_MAX_SEQLEN_Q,
                    False,
                    False,
                    capability,
                    use_sinks=model.sinks,
                )
                assert invariant.key() in compiled


def test_batch_invariant_rows_equal_alone_and_in_a_mixed_batch():
    # Under batch_invariant a row's program has one shape whatever else is in the step: a decode row alone
    # and beside a long prefill (which would pick a larger tile) gives the same floats (the interpreter off CUDA).
    q_lens, k_lens = [1, 40, 1, 7], [9, 40, 33, 20]
    query, k_cache, v_cache, tables, cu, seqlens = make_batch(q_lens, k_lens, 8, 2, 32, 16, torch.float32)
    batch = paged_attention.paged_attention_triton(
        query, k_cache, v_cache, tables, cu, seqlens, 0.2, batch_invariant=True
    )
    for b in (0, 2, 3):
        start, q_len = int(cu[b]), q_lens[b]
        alone = paged_attention.paged_attention_triton(
            query[start : start + q_len].clone(),
            k_cache,
            v_cache,
            tables[b : b + 1],
            torch.tensor([0, q_len], dtype=cu.dtype, device=cu.device),
            seqlens[b : b + 1],
            0.2,
            batch_invariant=True,
        )
        assert torch.equal(alone, batch[start : start + q_len]), b
