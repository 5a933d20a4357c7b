"""The PyTorch reference attention: bucketing decodes by context length changes no output."""

import torch

import cbrun.kernels.reference as ref


def test_decode_buckets_equal_one_padded_group(monkeypatch):
    g = torch.Generator().manual_seed(0)
    num_pages, page, num_kv_heads, head_dim, num_heads = 400, 4, 2, 8, 4
    k_cache = torch.randn(num_pages, page, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_pages, page, num_kv_heads, head_dim, generator=g)
    q_lens = [1] * 70 + [5]  # more decodes than one bucket holds, and a prefill chunk
    seqlens_k = torch.randint(1, 60, (len(q_lens),), generator=g)
    block_tables = torch.randint(2, num_pages, (len(q_lens), 15), generator=g)
    cu = torch.tensor([0] + q_lens).cumsum(0)
    query = torch.randn(int(cu[-1]), num_heads, head_dim, generator=g)
    bucketed_plan = ref.build_gather_plan(block_tables, cu, seqlens_k, page)
    assert len(bucketed_plan.groups) == 4  # 32 + 32 + 6 decodes, 1 prefill group
    bucketed = ref.paged_attention_ref(query, k_cache, v_cache, bucketed_plan, 0.3)
    monkeypatch.setattr(ref, "DECODE_BUCKET_SIZE", 10**6)
    single = ref.paged_attention_ref(
        query, k_cache, v_cache, ref.build_gather_plan(block_tables, cu, seqlens_k, page), 0.3
    )
    torch.testing.assert_close(bucketed, single, rtol=1e-5, atol=1e-6)


def test_prefill_tiles_equal_one_padded_group(monkeypatch):
    """Prefills cut into causal tiles (some with a cached prefix, one past a sliding window) attend as untiled."""
    g = torch.Generator().manual_seed(1)
    num_pages, page, num_kv_heads, head_dim, num_heads = 300, 4, 2, 8, 4
    k_cache = torch.randn(num_pages, page, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_pages, page, num_kv_heads, head_dim, generator=g)
    q_lens = [70, 1, 33, 5, 40]
    seqlens_k = torch.tensor([70, 20, 90, 5, 41])  # 57 and 1 cached tokens before the 2nd and last prefill
    block_tables = torch.randint(2, num_pages, (len(q_lens), 25), generator=g)
    cu = torch.tensor([0] + q_lens).cumsum(0)
    query = torch.randn(int(cu[-1]), num_heads, head_dim, generator=g)
    monkeypatch.setattr(ref, "PREFILL_BUCKET_SIZE", 3)
    for window in (None, 24):
        plan = ref.build_gather_plan(block_tables, cu, seqlens_k, page, window)
        assert len(plan.groups) == 1 + 3  # the decode; 3 + 2 + 1 + 2 tiles of at most 32 rows, 3 a group
        tiled = ref.paged_attention_ref(query, k_cache, v_cache, plan, 0.3)
        with monkeypatch.context() as m:
            m.setattr(ref, "PREFILL_TILE", 10**6)
            m.setattr(ref, "PREFILL_BUCKET_SIZE", 10**6)
            untiled_plan = ref.build_gather_plan(block_tables, cu, seqlens_k, page, window)
            assert len(untiled_plan.groups) == 2
            untiled = ref.paged_attention_ref(query, k_cache, v_cache, untiled_plan, 0.3)
        torch.testing.assert_close(tiled, untiled, rtol=1e-5, atol=1e-6)


def test_sinks_equal_transformers_gpt_oss_eager():
    """The reference's sinks are transformers' gpt-oss ``eager_attention_forward``: a per-head logit beside the
    scores in the softmax, dropped before the weighted sum of V (one request, contiguous pages, causal)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(2)
    length, page, num_kv_heads, head_dim, num_heads = 11, 4, 2, 8, 4
    q = torch.randn(1, num_heads, length, head_dim, generator=g)
    k = torch.randn(1, num_kv_heads, length, head_dim, generator=g)
    v = torch.randn(1, num_kv_heads, length, head_dim, generator=g)
    sinks = torch.linspace(-2.0, 3.0, num_heads)
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    module = SimpleNamespace(num_key_value_groups=num_heads // num_kv_heads, sinks=sinks, training=False)
    want, _ = eager_attention_forward(module, q, k, v, causal, scaling=0.3)  # (1, T, H, D)
    num_pages = -(-length // page)
    pad = num_pages * page - length
    k_cache = torch.nn.functional.pad(k[0].transpose(0, 1), (0, 0, 0, 0, 0, pad)).view(num_pages, page, 2, 8)
    v_cache = torch.nn.functional.pad(v[0].transpose(0, 1), (0, 0, 0, 0, 0, pad)).view(num_pages, page, 2, 8)
    plan = ref.build_gather_plan(torch.arange(num_pages)[None], torch.tensor([0, length]), torch.tensor([length]), page)
    got = ref.paged_attention_ref(q[0].transpose(0, 1), k_cache, v_cache, plan, 0.3, sinks=sinks)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-6)
