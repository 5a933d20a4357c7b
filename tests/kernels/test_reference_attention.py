"""The PyTorch reference attention: bucketing decodes by context length changes no output."""

import torch

import kernels.reference as ref


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
    single = ref.paged_attention_ref(query, k_cache, v_cache, ref.build_gather_plan(block_tables, cu, seqlens_k,
                                                                                    page), 0.3)
    torch.testing.assert_close(bucketed, single, rtol=1e-5, atol=1e-6)
