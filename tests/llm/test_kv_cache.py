import pytest

from kiln.llm.kv_cache import CacheCapacityError, KVCacheManager
from kiln.llm.request import Request
from kiln.llm.sampling import SamplingParams


def req(rid, n, max_tokens=4, base=0):
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens))


def test_blocks_are_allocated_as_tokens_grow_and_freed():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    r = req("a", 10)
    assert kv.allocate(r, 10)
    assert len(kv.block_table("a")) == 3 and kv.num_free_blocks == 5
    r.num_computed_tokens = 10
    assert kv.allocate(r, 2)  # 12 tokens still fit 3 blocks
    assert len(kv.block_table("a")) == 3
    r.num_computed_tokens = 12
    assert kv.allocate(r, 1) and len(kv.block_table("a")) == 4
    assert kv.usage == pytest.approx(4 / 8)
    kv.free_request("a")
    assert kv.num_free_blocks == 8 and kv.block_table("a") == []


def test_allocation_fails_whole_when_short():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    assert kv.allocate(req("a", 8), 8)
    assert not kv.allocate(req("b", 8), 8)
    assert kv.num_free_blocks == 1 and kv.block_table("b") == []


def test_request_that_can_never_fit_is_refused():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.check_fits(req("ok", 10, max_tokens=6))
    with pytest.raises(CacheCapacityError, match="needs 5 KV-cache blocks.*pool has 4"):
        kv.check_fits(req("big", 10, max_tokens=7))


def test_prefix_cache_hits_full_blocks_of_the_same_prefix():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", 10)
    assert kv.computed_prefix(a) == 0
    kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a, 10)
    b = Request("b", list(range(9)) + [99], SamplingParams())
    assert kv.computed_prefix(b) == 8  # two full blocks shared, the third differs
    assert kv.block_table("b") == kv.block_table("a")[:2]
    c = Request("c", [5] + list(range(1, 10)), SamplingParams())
    assert kv.computed_prefix(c) == 0  # a different first block breaks the chain
    kv.free_request("a")
    kv.free_request("b")
    d = req("d", 10)
    assert kv.computed_prefix(d) == 8  # freed blocks stay findable


def test_prefix_hit_leaves_the_last_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", 8)
    kv.allocate(a, 8)
    kv.cache_full_blocks(a, 8)
    assert kv.computed_prefix(req("b", 8)) == 4


def test_reused_blocks_lose_their_hash():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = req("a", 8)
    kv.allocate(a, 8)
    kv.cache_full_blocks(a, 8)
    kv.free_request("a")
    other = req("o", 8, base=50)
    assert kv.allocate(other, 8)  # takes both blocks, evicting a's prefix
    kv.free_request("o")
    assert kv.computed_prefix(req("a2", 9)) == 0
