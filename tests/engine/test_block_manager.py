"""Block manager: exact block ids, reference counts, prefix-cache hits and eviction order."""

import pytest

from cbrun.engine.core.block_manager import ROOT_HASH, BlockManager, sha256_block_hash, truncated_block_hash
from cbrun.engine.core.cache_spec import CacheSpec
from cbrun.engine.core.kv_layout import KVLayout
from cbrun.engine.core.request import Request
from cbrun.engine.sampling_params import SamplingParams


def make_request(tokens, computed: int = 0) -> Request:
    request = Request("r", list(tokens), SamplingParams())
    request.num_computed_tokens = computed
    return request


def admit(bm: BlockManager, request: Request) -> list[int]:
    """Admit like the scheduler does: take the cached prefix, allocate the rest of the prompt."""
    cached = bm.find_cached_prefix(request)
    assert bm.allocate_slots(request, request.num_tokens - len(cached) * bm.page_size, cached)
    request.num_computed_tokens = request.num_tokens
    return cached


def test_allocation_is_all_or_nothing():
    bm = BlockManager(CacheSpec.build(num_blocks=4, page_size=4), enable_prefix_caching=False)
    a = make_request(range(10))
    assert bm.allocate_slots(a, 10)
    assert a.block_table == [2, 3, 4]  # chunks 0 and 1 are reserved for padding
    b = make_request(range(100, 108))
    assert not bm.allocate_slots(b, 8)  # needs 2, only 1 free
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.free(a)
    assert bm.num_free_blocks == 4 and not any(bm.ref_counts)
    bm.check_consistency()


def test_growth_allocates_only_at_block_boundaries():
    bm = BlockManager(CacheSpec.build(num_blocks=8, page_size=4), enable_prefix_caching=False)
    r = make_request(range(4))
    assert bm.allocate_slots(r, 4)
    r.num_computed_tokens = 4
    assert bm.num_blocks_needed(r, 1) == 1
    assert bm.allocate_slots(r, 1)
    assert r.block_table == [2, 3]
    r.num_computed_tokens = 5
    assert bm.num_blocks_needed(r, 1) == 0


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(CacheSpec.build(num_blocks=10, page_size=4))
    a = make_request(list(range(9)))  # two full blocks + 1 token
    assert admit(bm, a) == []
    b = make_request(list(range(8)) + [99, 98])
    cached = admit(bm, b)
    assert cached == a.block_table[:2]
    assert [bm.ref_counts[x] for x in cached] == [2, 2]
    bm.free(a)
    assert [bm.ref_counts[x] for x in cached] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 10
    bm.check_consistency()


def test_last_prompt_token_is_never_served_from_cache():
    bm = BlockManager(CacheSpec.build(num_blocks=10, page_size=4))
    a = make_request(list(range(8)))  # exactly two blocks
    admit(bm, a)
    same = make_request(list(range(8)))
    assert len(bm.find_cached_prefix(same)) == 1  # the second block holds the last token: computed again


def test_freed_blocks_stay_cached_until_evicted_oldest_first():
    bm = BlockManager(CacheSpec.build(num_blocks=4, page_size=2))
    a = make_request([1, 2, 3, 4, 5])  # blocks 2, 3 full; 4 partial
    admit(bm, a)
    bm.free(a)  # tail first: 4 (no hash) back to the pool; 3 then 2 cached
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2
    assert len(bm.find_cached_prefix(make_request([1, 2, 3, 4, 9]))) == 2
    # Needs 3 blocks: 4 (the most recently freed) and 5 from the pool, then evict the deepest cached (3).
    big = make_request(range(100, 106))
    assert bm.allocate_slots(big, 6)
    assert big.block_table == [4, 5, 3]
    assert bm.num_evicted_blocks == 1
    assert len(bm.find_cached_prefix(make_request([1, 2, 3, 4, 9]))) == 1  # block 2 still hits
    bm.free(big)
    bm.check_consistency()


def test_cache_hit_never_makes_allocation_fail():
    bm = BlockManager(CacheSpec.build(num_blocks=3, page_size=2))
    a = make_request([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    b = make_request([1, 2, 7, 8, 9])  # hits block of [1, 2]; needs 2 more: exactly what is left
    cached = bm.find_cached_prefix(b)
    assert bm.allocate_slots(b, 3, cached)
    bm.check_consistency()


def test_hash_collision_never_serves_other_tokens():
    bm = BlockManager(CacheSpec.build(num_blocks=8, page_size=2), hash_fn=lambda parent, tokens: b"same")
    a = make_request([1, 2, 3])
    admit(bm, a)
    b = make_request([7, 8, 9])
    assert bm.find_cached_prefix(b) == []  # same hash, other tokens: a miss


def test_hybrid_pool_tiles_full_and_sliding_blocks_and_admits_only_when_both_fit():
    # 2 full + 1 sliding layers: a chunk is lcm(2, 1) = 2 pages = 1 full block or 2 sliding blocks.
    layout = KVLayout(("full", "sliding", "full"), sliding_window=4)
    bm = BlockManager(CacheSpec.build(num_blocks=4, page_size=2, layout=layout, max_chunk_tokens=2, max_model_len=64))
    assert bm.spec.chunk_pages == 2 and bm.pool.num_usable_chunks == 6  # 4 blocks x 3 layers / 2 pages
    assert bm.ring_blocks == 4  # ceil((4 - 1 + 2) / 2) + 1
    r = make_request(range(20))
    assert not bm.allocate_slots(r, 20)  # 10 full blocks: more than the pool; nothing reserved
    assert r.block_table == [] and r.sliding_block_table == [] and bm.pool.num_free_chunks == 6
    assert bm.allocate_slots(r, 8)  # 4 full blocks (4 chunks) + 4 ring blocks (2 chunks)
    assert len(r.block_table) == 4 and len(r.sliding_block_table) == 4 and bm.pool.num_free_chunks == 0
    r.num_computed_tokens = 8
    assert bm.allocate_slots(r, 0) and len(r.sliding_block_table) == bm.ring_blocks  # never beyond the ring
    assert all(c >= 2 for c in (b // bm.full.blocks_per_chunk for b in r.block_table))  # padding chunks unused
    assert not bm.allocate_slots(r, 2)  # a 5th full block: no chunk left
    bm.free(r)
    assert bm.pool.num_free_chunks == 6
    bm.check_consistency()


def test_prefix_sharing_is_off_with_sliding_layers():
    layout = KVLayout(("sliding", "sliding"), sliding_window=8)
    bm = BlockManager(CacheSpec.build(num_blocks=16, page_size=4, layout=layout, max_chunk_tokens=4, max_model_len=64))
    assert not bm.enable_prefix_caching
    a = make_request(range(12))
    admit(bm, a)
    assert bm.find_cached_prefix(make_request(range(12))) == []


def test_colliding_8_bit_hashes_are_never_shared():
    bm = BlockManager(CacheSpec.build(num_blocks=16, page_size=2), hash_fn=truncated_block_hash(8))
    seen = {}
    for i in range(257):  # 256 hash values: two of 257 blocks must collide
        tokens = (i, i + 1000)
        first = seen.setdefault(bm.hash_fn(ROOT_HASH, tokens), tokens)
        if first != tokens:
            break
    a, b, c = make_request(first + (1,)), make_request(tokens + (1,)), make_request(first + (2,))
    admit(bm, a)
    assert bm.find_cached_prefix(b) == [] and bm.num_hash_collisions == 1  # same hash, other tokens: a miss
    assert bm.find_cached_prefix(c) == a.block_table[:1]  # same tokens: a hit
    assert truncated_block_hash(256) is sha256_block_hash
    with pytest.raises(ValueError, match="multiple of 8"):
        truncated_block_hash(12)


def test_a_block_after_a_duplicate_is_served_in_the_chain_of_the_cached_copy():
    bm = BlockManager(CacheSpec.build(num_blocks=16, page_size=2))
    a = make_request([1, 2, 3, 4, 9])
    admit(bm, a)
    b = make_request([1, 2, 5, 6, 9])  # computed its [1, 2] block again (admitted without the lookup)
    assert bm.allocate_slots(b, b.num_tokens)
    b.num_computed_tokens = b.num_tokens
    assert b.block_table[0] != a.block_table[0]  # the duplicate stays out of the cache
    c = make_request([1, 2, 5, 6, 7])
    assert bm.find_cached_prefix(c) == [a.block_table[0], b.block_table[1]]  # b's [5, 6] follows a's [1, 2]
    assert bm.num_hash_collisions == 0
