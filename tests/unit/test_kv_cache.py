"""Block pool, prefix cache and the sliding-window group, driven directly (no model)."""

from __future__ import annotations

import torch

from deepinfer.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec, group_layers
from deepinfer.sampling_params import SamplingParams
from deepinfer.types.block_hashes import extra_key
from deepinfer.types.request import Request

BS = 4
FULL = FullAttentionSpec(2, 8, torch.float32)
SLIDING = SlidingWindowSpec(2, 8, torch.float32, sliding_window=6)


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), frozenset(), 8, cache_salt=salt,
                   extra_key=extra_key("m", salt), block_size=BS)


def compute_all(manager: KVCacheManager, request: Request) -> None:
    """Admit `request` with any prefix hit and mark all its tokens computed, as a step would."""
    hit = manager.find_prefix_hit(request)
    assert manager.allocate(request, request.num_tokens - hit.num_computed_tokens, hit)
    request.num_computed_tokens = request.num_tokens
    manager.cache_computed_blocks(request)


def test_block_pool_allocate_free_and_lru_eviction():
    pool = BlockPool(num_blocks=5, num_groups=1)
    assert pool.num_free_blocks == 4  # block 0 is the null block
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert pool.allocate(1) is None and NULL_BLOCK_ID not in a + b
    pool.cache(0, a[0], b"h0")
    pool.cache(0, a[1], b"h1")
    pool.free(a[::-1])          # cached blocks go to the back, tail block first
    pool.free(b)                # empty blocks go to the front: reused first
    assert pool.lookup(0, b"h0") == a[0]
    first = pool.allocate(2)
    assert set(first) == set(b) and pool.counters[0].evictions == 0
    pool.allocate(1)            # now a cached block must be evicted: the tail one (h1) first
    assert pool.lookup(0, b"h1") is None and pool.lookup(0, b"h0") == a[0]
    assert pool.counters[0].evictions == 1


def test_prefix_hit_miss_and_shared_blocks():
    manager = KVCacheManager(group_layers([FULL, FULL]), num_blocks=32, block_size=BS)
    first = make_request("a", list(range(10)))
    compute_all(manager, first)
    second = make_request("b", list(range(10)) + [99])
    hit = manager.find_prefix_hit(second)
    assert hit.num_computed_tokens == 8 and hit.block_ids[0] == first.block_ids[0][:2]   # two full blocks reused
    miss = make_request("c", [7] + list(range(1, 10)))
    assert manager.find_prefix_hit(miss).num_computed_tokens == 0           # first block differs: chain breaks
    # A hit never covers the whole prompt: one token is left to compute the first logits.
    same = make_request("d", list(range(8)))
    assert manager.find_prefix_hit(same).num_computed_tokens == 4
    assert manager.allocate(second, second.num_tokens - hit.num_computed_tokens, hit)
    assert manager.pool.blocks[hit.block_ids[0][0]].ref_count == 2   # shared by both requests


def test_salt_isolates_tenants():
    manager = KVCacheManager(group_layers([FULL]), num_blocks=32, block_size=BS)
    compute_all(manager, make_request("a", list(range(12)), salt="tenant-1"))
    assert manager.find_prefix_hit(make_request("b", list(range(12)), salt="tenant-2")).num_computed_tokens == 0
    assert manager.find_prefix_hit(make_request("c", list(range(12)))).num_computed_tokens == 0
    assert manager.find_prefix_hit(make_request("d", list(range(12)), salt="tenant-1")).num_computed_tokens == 8


def test_freed_cached_blocks_are_hit_until_evicted():
    manager = KVCacheManager(group_layers([FULL]), num_blocks=5, block_size=BS)
    first = make_request("a", list(range(9)))
    compute_all(manager, first)
    manager.free(first)
    assert manager.find_prefix_hit(make_request("b", list(range(9)))).num_computed_tokens == 8
    filler = make_request("c", [50 + i for i in range(16)])
    compute_all(manager, filler)   # needs all 4 blocks: evicts the cached ones
    assert manager.find_prefix_hit(make_request("d", list(range(9)))).num_computed_tokens == 0
    assert manager.pool.counters[0].evictions == 2


def test_sliding_window_group_frees_out_of_window_blocks():
    groups = group_layers([SLIDING, FULL])
    assert [g.spec.kind for g in groups] == ["sliding_window", "full"]
    manager = KVCacheManager(groups, num_blocks=64, block_size=BS)
    request = make_request("a", list(range(5)))
    compute_all(manager, request)
    for token in range(20):                      # decode 20 tokens, one block-step at a time
        request.append_output_token(100 + token)
        assert manager.allocate(request, 1)
        request.num_computed_tokens += 1
        manager.cache_computed_blocks(request)
    sliding, full = request.block_ids
    # The last step computed position 24, whose query saw keys 19..24 (window 6): blocks 0..3
    # (tokens 0..15) were freed before it, block 4 (tokens 16..19) was still needed.
    assert sliding[:4] == [NULL_BLOCK_ID] * 4 and NULL_BLOCK_ID not in sliding[4:]
    assert NULL_BLOCK_ID not in full and len(full) == 7
    request.append_output_token(7)
    assert manager.allocate(request, 1)          # position 25 sees 20..25: block 4 goes too
    assert request.block_ids[0][4] == NULL_BLOCK_ID
    request.num_computed_tokens += 1
    # The freed blocks are still cached, so a new request with the same prefix hits in both
    # groups as long as its last window is cached.
    again = make_request("b", request.all_token_ids[:24] + [1])
    hit = manager.find_prefix_hit(again)
    assert hit.num_computed_tokens == 24 and hit.block_ids[0][:4] == [NULL_BLOCK_ID] * 4


def test_allocate_is_all_or_nothing():
    manager = KVCacheManager(group_layers([FULL]), num_blocks=4, block_size=BS)
    request = make_request("a", list(range(20)))
    assert not manager.allocate(request, 20)     # needs 5 blocks, 3 exist
    assert manager.pool.num_free_blocks == 3 and request.block_ids == [[]]
