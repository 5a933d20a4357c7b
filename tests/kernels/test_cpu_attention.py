"""The C paged-attention kernel (``cbrun.kernels.cpu_attention``) against the PyTorch reference on ragged batches.

Contexts end on, just before and just after page boundaries; pages are shuffled; every cache slot no request owns
is NaN, so a kernel that reads past a request's context (or a masked slot) fails the comparison. The kernel's
8-lane loops (head_dim % 8 == 0) must give exactly the floats of its generic loops, whose summation order they
reproduce (``StepKernels.attention(..., lane_loops=False)``): decode, verify and prefill tiles, both score orders,
every V-pass width.
"""

import pytest
import torch

from cbrun.engine.model.layers.rotary_embedding import apply_rope as _rope
from cbrun.engine.model.layers.rotary_embedding import rope_tables as _rope_tables
from cbrun.kernels.cpu_attention import (
    SOURCE,
    StepKernels,
    load_source,
    paged_attention_cpu,
    rope_cpu,
    silu_mul_cpu,
    unavailable_reason,
    write_kv_cache_cpu,
)
from cbrun.kernels.reference import build_gather_plan, paged_attention_ref, write_kv_cache_ref

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"CPU attention kernel unavailable: {unavailable_reason()}"
)

PAGE = 4
# (query lengths, context lengths): decodes, a prefill of whole pages, a chunk after cached context, a request with
# no query rows, contexts of 1, PAGE - 1, PAGE, PAGE + 1 and 2 * PAGE + 1 tokens.
RAGGED = ([1, 1, 1, 1, 8, 5, 0, 1, 13, 1], [1, 3, 4, 5, 8, 9, 6, 40, 21, 17])


def make_batch(q_lens, k_lens, num_heads, num_kv_heads, head_dim, seed=0, page=PAGE):
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-k // page) for k in k_lens]
    num_pages = sum(pages) + 2  # page 0 finite and unowned (the reference's padding target), one spare
    k_cache = torch.full((num_pages, page, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[0], v_cache[0] = 0.0, 0.0
    order = (torch.randperm(num_pages - 2, generator=gen) + 1).tolist()
    width = max(pages)
    tables = torch.zeros(len(q_lens), width, dtype=torch.int32)
    for b, (n, k_len) in enumerate(zip(pages, k_lens)):
        own, order = order[:n], order[n:]
        tables[b, :n] = torch.tensor(own, dtype=torch.int32)
        for j in range(k_len):  # only the context's slots get values
            at, offset = own[j // page], j % page
            k_cache[at, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[at, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
    cu = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]) + 2, num_heads, head_dim, generator=gen)  # two trailing padding rows
    return query, k_cache, v_cache, tables, cu, torch.tensor(k_lens, dtype=torch.int32)


def reference(query, k_cache, v_cache, tables, cu, seqlens, scale, softcap=None, window=None, sinks=None):
    """The reference over a copy of the cache whose unowned slots are 0: it reads whole pages and masks them."""
    plan = build_gather_plan(tables, cu, seqlens, k_cache.shape[1], window)
    return paged_attention_ref(
        query, torch.nan_to_num(k_cache), torch.nan_to_num(v_cache), plan, scale, softcap, sinks=sinks
    )


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 2, 8), (6, 6, 16), (8, 1, 64), (4, 2, 12), (6, 2, 24), (4, 4, 128)]
)
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 2.0)])
def test_ragged_batch_matches_reference(num_heads, num_kv_heads, head_dim, window, softcap):
    query, k_cache, v_cache, tables, cu, seqlens = make_batch(*RAGGED, num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    out = paged_attention_cpu(query, k_cache, v_cache, tables, cu, seqlens, scale, softcap, window)
    expected = reference(query, k_cache, v_cache, tables, cu, seqlens, scale, softcap, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert (out[int(cu[-1]) :] == 0).all()  # padding rows


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 8), (4, 2, 12), (8, 2, 64)])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 2.0)])
@pytest.mark.parametrize("lane_loops", [True, False])
def test_sinks_match_reference(num_heads, num_kv_heads, head_dim, window, softcap, lane_loops):
    """Attention sinks (gpt-oss): one logit per head in the softmax denominator; sinks well above and below the
    scores, so they change the outputs (checked against no sinks)."""
    query, k_cache, v_cache, tables, cu, seqlens = make_batch(*RAGGED, num_heads, num_kv_heads, head_dim, seed=5)
    sinks = torch.linspace(-3.0, 4.0, num_heads)
    scale = head_dim**-0.5
    out = StepKernels(k_cache, v_cache).attention(
        query, tables, cu, seqlens, scale, softcap, window, lane_loops=lane_loops, sinks=sinks
    )
    expected = reference(query, k_cache, v_cache, tables, cu, seqlens, scale, softcap, window, sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    without = reference(query, k_cache, v_cache, tables, cu, seqlens, scale, softcap, window)
    assert not torch.allclose(out[: int(cu[-1])], without[: int(cu[-1])], atol=1e-3)


def test_sinks_in_the_online_pass_match_reference():
    """Tiles too long for the two-pass buffer take the online softmax, which adds the sink too."""
    query, k_cache, v_cache, tables, cu, seqlens = make_batch([13, 1], [700, 37], 8, 1, 64, seed=6)
    sinks = torch.linspace(-2.0, 6.0, 8)
    out = paged_attention_cpu(query, k_cache, v_cache, tables, cu, seqlens, 0.125, sinks=sinks)
    expected = reference(query, k_cache, v_cache, tables, cu, seqlens, 0.125, sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 650, 300])
def test_long_contexts_match_reference(window):
    """Tiles whose scores fit the kernel's two-pass buffer and tiles that do not (the online-softmax pass)."""
    # 13 rows x 8 query heads x ~700 keys (window None or 650) is over the two-pass budget of 65536 scores, so the
    # online pass runs; a window of 300 brings it under; the decode row is always under it.
    query, k_cache, v_cache, tables, cu, seqlens = make_batch([13, 1, 3], [700, 650, 37], 8, 1, 64, seed=4)
    out = paged_attention_cpu(query, k_cache, v_cache, tables, cu, seqlens, 0.125, None, window)
    expected = reference(query, k_cache, v_cache, tables, cu, seqlens, 0.125, None, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_threads_and_page_offset_give_the_same_output():
    query, k_cache, v_cache, tables, cu, seqlens = make_batch(*RAGGED, 4, 2, 8, seed=1)
    # The same cache as the second of two layers per block: every page shifted by one.
    k2 = torch.stack((torch.zeros_like(k_cache), k_cache), 1).flatten(0, 1)
    v2 = torch.stack((torch.zeros_like(v_cache), v_cache), 1).flatten(0, 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention_cpu(query, k_cache, v_cache, tables, cu, seqlens, 0.3)
        torch.set_num_threads(2)
        two = paged_attention_cpu(query, k2, v2, tables * 2, cu, seqlens, 0.3, page_offset=1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each query vector's sums run in the same order on any thread
    three = paged_attention_cpu(query, k_cache, v_cache, tables, cu, seqlens, 0.3, num_threads=3)
    assert torch.equal(one, three)  # the kernel's own thread count, whatever torch's is


def test_rejects_what_it_cannot_run():
    query, k_cache, v_cache, tables, cu, seqlens = make_batch([1], [3], 2, 1, 8)
    with pytest.raises(ValueError, match="float32"):
        paged_attention_cpu(query.half(), k_cache.half(), v_cache.half(), tables, cu, seqlens, 0.3)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention_cpu(query[..., :4], k_cache, v_cache, tables, cu, seqlens, 0.3)


@pytest.mark.parametrize("slot_offset", [0, 8])
def test_kv_write_gives_the_references_bits(slot_offset):
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    slots = torch.tensor([5, -1, 0, 15, -1, 9])  # padding tokens (-1) write nowhere; 24 slots in all
    caches = [torch.randn(6, 4, 2, 8, generator=gen) for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv_cache_ref(key, value, *expected, torch.where(slots >= 0, slots + slot_offset, slots))
    write_kv_cache_cpu(key, value, *caches, slots, slot_offset)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_kv_write_refuses_a_slot_outside_the_cache_and_writes_nothing():
    key = value = torch.ones(2, 2, 8)
    k_cache, v_cache = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="outside the cache's 8 slots"):
        write_kv_cache_cpu(key, value, k_cache, v_cache, torch.tensor([1, 8]))  # slot 1 is fine, 8 is not
    with pytest.raises(ValueError, match="outside"):
        write_kv_cache_cpu(key, value, k_cache, v_cache, torch.tensor([1, 3]), slot_offset=5)
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(ValueError, match="do not fit"):
        write_kv_cache_cpu(key[..., :4], value[..., :4], k_cache, v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="int64"):
        write_kv_cache_cpu(key, value, k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("head_dim", [8, 64, 6])
def test_rope_gives_the_pytorch_ops_floats(head_dim):
    # The lean model's tables and PyTorch RoPE are the oracle, bit for bit: a fused multiply-add would differ.
    gen = torch.Generator().manual_seed(head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin_signed = _rope_tables(inv_freq, 1.0, 512, torch.float32)
    x = torch.randn(37, 3, head_dim, generator=gen) * 10
    positions = torch.randint(0, 512, (37,), generator=gen)
    expected = _rope(x, cos[positions][:, None], sin_signed[positions][:, None])
    assert torch.equal(rope_cpu(x.clone(), cos, sin_signed, positions), expected)


def test_rope_refuses_a_position_outside_the_tables_and_leaves_x():
    cos = sin_signed = torch.ones(4, 8)
    x = torch.randn(2, 1, 8)
    before = x.clone()
    with pytest.raises(ValueError, match="outside the RoPE tables' 4 positions"):
        rope_cpu(x, cos, sin_signed, torch.tensor([1, 4]))
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match="int64"):
        rope_cpu(x, cos, sin_signed, torch.tensor([1, 2], dtype=torch.int32))


def test_step_kernels_reused_by_layers_match_the_one_call_functions_and_check_each_new_tensor():
    # One StepKernels serves every layer of a step: the step's tensors are converted once, each layer's own tensors
    # are checked on every call, and a tensor not seen before (another object) is checked again.
    query, k_cache, v_cache, tables, cu, seqlens = make_batch(*RAGGED, 4, 2, 8, seed=5)
    kernels = StepKernels(k_cache, v_cache, num_threads=1)
    for layer in range(3):  # as layers do: the same tables and lengths, a new query each time
        q = query * (layer + 1)
        assert torch.equal(
            kernels.attention(q, tables, cu, seqlens, 0.3),
            paged_attention_cpu(q, k_cache, v_cache, tables, cu, seqlens, 0.3, num_threads=1),
        )
    with pytest.raises(ValueError, match="float32"):
        kernels.attention(query.double(), tables, cu, seqlens, 0.3)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.attention(query[..., :4], tables, cu, seqlens, 0.3)

    gen = torch.Generator().manual_seed(4)
    key, value = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    slots = torch.tensor([2, -1, 7])
    caches = [torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)]
    expected = [c.clone() for c in caches]
    writer = StepKernels(*caches)
    for offset in (0, 4):  # two layers of one group: one slot mapping, shifted in C
        writer.write_kv(key, value, slots, offset)
        write_kv_cache_cpu(key, value, *expected, slots, offset)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    with pytest.raises(ValueError, match="int64"):
        writer.write_kv(key, value, slots.to(torch.int32))
    with pytest.raises(ValueError, match="int64 of shape"):
        writer.write_kv(key[:2], value[:2], slots)

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    cos, sin_signed = _rope_tables(inv_freq, 1.0, 16, torch.float32)
    x, positions = torch.randn(3, 2, 8, generator=gen), torch.tensor([0, 5, 15])
    rope = StepKernels.rope_only()
    rotated = rope_cpu(x.clone(), cos, sin_signed, positions)
    assert torch.equal(rope.rope(x.clone(), cos, sin_signed, positions), rotated)
    with pytest.raises(ValueError, match="one"):  # the same cos table with a sin table of another shape
        rope.rope(x.clone(), cos, sin_signed[:8], positions)
    with pytest.raises(ValueError, match="outside the RoPE tables' 16 positions"):
        rope.rope(x.clone(), cos, sin_signed, torch.tensor([0, 5, 16]))


# (query lengths, context lengths) of the shapes the engine runs: decode rows, speculative verify rows (1 + k),
# prefill chunks of 1 to 3 tiles (TILE_Q = 16 rows) after cached context, and a request with no query rows.
SHAPES = {
    "decode": ([1] * 9, [1, 7, 8, 9, 16, 17, 40, 63, 100]),
    "verify": ([2, 3, 4, 5, 5, 1], [2, 9, 17, 24, 70, 33]),
    "prefill": ([16, 7, 33, 0, 40], [16, 30, 60, 5, 41]),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(8, 4, 8), (6, 2, 8), (4, 4, 16), (4, 2, 24), (8, 4, 64), (2, 1, 128)]
)
@pytest.mark.parametrize("page", [4, 8, 16])
def test_lane_loops_give_the_generic_loops_floats(shape, num_heads, num_kv_heads, head_dim, page):
    """Same floats, not just close ones: the engine's greedy tokens must not depend on which loops ran (a float32
    near-tie such as tests/engine/test_near_tie_row.py's flips on one ulp)."""
    query, k_cache, v_cache, tables, cu, seqlens = make_batch(
        *SHAPES[shape], num_heads, num_kv_heads, head_dim, seed=page + head_dim, page=page
    )
    scale = head_dim**-0.5
    for window, softcap in ((None, None), (6, None), (None, 2.0)):
        lanes = paged_attention_cpu(query, k_cache, v_cache, tables, cu, seqlens, scale, softcap, window)
        generic = StepKernels(k_cache, v_cache).attention(
            query, tables, cu, seqlens, scale, softcap, window, lane_loops=False
        )
        assert torch.equal(lanes, generic)
        expected = reference(query, k_cache, v_cache, tables, cu, seqlens, scale, softcap, window)
        torch.testing.assert_close(lanes, expected, rtol=1e-5, atol=1e-5)


def test_lane_loops_with_every_thread_count_and_head_split():
    """Two threads split a batch of few tiles by KV heads (items of fewer heads, so narrower V passes); the floats
    stay the generic loops' at one thread."""
    query, k_cache, v_cache, tables, cu, seqlens = make_batch([1, 3], [50, 20], 16, 8, 8, seed=7, page=16)
    generic = StepKernels(k_cache, v_cache, num_threads=1).attention(query, tables, cu, seqlens, 0.3, lane_loops=False)
    for threads in (1, 2, 3):
        out = paged_attention_cpu(query, k_cache, v_cache, tables, cu, seqlens, 0.3, num_threads=threads)
        assert torch.equal(out, generic)


def test_load_source_builds_a_kernel_of_the_same_contract(tmp_path):
    """benchmarks.cpu_attention --paired loads another version of the source beside this one."""
    copy = tmp_path / "cpu_paged_attention.c"
    copy.write_text(SOURCE.read_text() + "\n/* another version */\n")
    query, k_cache, v_cache, tables, cu, seqlens = make_batch(*RAGGED, 4, 2, 8, seed=2)
    other = load_source(copy)(query, k_cache, v_cache, tables, cu, seqlens, 0.3)
    assert torch.equal(other, paged_attention_cpu(query, k_cache, v_cache, tables, cu, seqlens, 0.3))


@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("window", [None, 5])
def test_batch_invariant_rows_equal_their_one_row_calls_at_any_thread_count(head_dim, window):
    # batch_invariant: every query row attends as a one-row request at its position (a decode row), so its floats
    # are those of that call whatever its prefill tile, its batch or the thread count; and close to the reference.
    q_lens, k_lens = [1, 8, 5, 1, 13, 20], [3, 8, 9, 40, 21, 300]
    query, k_cache, v_cache, tables, cu, seqlens = make_batch(q_lens, k_lens, 8, 2, head_dim, seed=3)
    args = (k_cache, v_cache, tables, cu, seqlens, 0.3)
    out = paged_attention_cpu(query, *args, sliding_window=window, num_threads=1, batch_invariant=True)
    for threads in (2, 3):
        again = paged_attention_cpu(query, *args, sliding_window=window, num_threads=threads, batch_invariant=True)
        assert torch.equal(again, out)
    for b, (q_len, k_len) in enumerate(zip(q_lens, k_lens)):
        for r in range(q_len):
            row = int(cu[b]) + r
            alone = paged_attention_cpu(
                query[row : row + 1].clone(),
                k_cache,
                v_cache,
                tables[b : b + 1],
                torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([k_len - q_len + r + 1], dtype=torch.int32),
                0.3,
                sliding_window=window,
                num_threads=1,
                batch_invariant=True,
            )
            assert torch.equal(out[row], alone[0]), (b, r)
    want = reference(query, k_cache, v_cache, tables, cu, seqlens, 0.3, window=window)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


def test_silu_mul_is_row_wise_and_close_to_torch():
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(300, 172, generator=gen) * 6, torch.randn(300, 172, generator=gen)
    gate[0, :3] = torch.tensor([-100.0, 0.0, 100.0])  # underflow, zero, saturation
    want = torch.nn.functional.silu(gate) * up
    out = silu_mul_cpu(gate.clone(), up, num_threads=2)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    for start, count in ((0, 1), (7, 2), (5, 33), (0, 300)):
        part = silu_mul_cpu(gate[start : start + count].clone(), up[start : start + count], num_threads=1)
        assert torch.equal(part, out[start : start + count])
    with pytest.raises(ValueError, match="one shape"):
        silu_mul_cpu(gate[:, :4].clone(), up[:, :5].clone())
