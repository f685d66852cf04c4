"""KV layer v2, driven directly (no model): each kind's rules, pools of several page shapes,
retention of sliding-window blocks, the replay resume point, the hash chain's root."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import CacheConfig
from deepinfer.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from deepinfer.kv_cache.manager import KVCacheManager, ReplayConfig, replay_config
from deepinfer.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec, group_layers
from deepinfer.kv_cache.tensors import KVLayout
from deepinfer.sampling_params import SamplingParams
from deepinfer.types.block_hashes import extra_key, hash_root
from deepinfer.types.request import Request

BS = 4
FULL = FullAttentionSpec(2, 8, torch.float32)
SLIDING = SlidingWindowSpec(2, 8, torch.float32, sliding_window=8)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_request(rid: str, tokens: list[int], root: bytes | None = None) -> Request:
    request = Request(rid, tokens, SamplingParams(max_tokens=8), frozenset(), 8,
                      extra_key=extra_key("m", None), block_size=BS)
    if root is not None:
        request.hash_root = root
    return request


def run(manager: KVCacheManager, request: Request):
    """Admit with any hit, compute every token as a step would, publish; returns the hit."""
    hit = manager.find_prefix_hit(request)
    assert manager.allocate(request, request.num_tokens - hit.num_computed_tokens, hit)
    request.num_computed_tokens = request.num_tokens
    manager.cache_computed_blocks(request)
    return hit


def first_turn(manager: KVCacheManager, clock: Clock | None = None, tokens: int = 40) -> list[list[int]]:
    """A finished request of `tokens` tokens whose blocks stay cached; with `clock`, time moves
    on one second (past a retention of 0). Returns its block tables as they were."""
    first = make_request("a", list(range(tokens)))
    run(manager, first)
    tables = [list(ids) for ids in first.block_ids]
    manager.free(first)
    if clock is not None:
        clock.now += 1
    return tables


def hybrid(replay: int = 0, full_kv: str = "keep", retention: float = 1e9, clock=None, blocks: int = 64):
    # Layers: sliding, full, sliding, full -> one sliding group, one full group, one pool.
    return KVCacheManager(group_layers([SLIDING, FULL, SLIDING, FULL]), blocks, BS,
                          replay=ReplayConfig(replay, full_kv), swa_retention_s=retention,
                          clock=clock or Clock())


# --------------------------------------------------------------------------- the kinds' rules
def test_each_kind_owns_its_rules():
    assert FULL.persisted and not FULL.expires and FULL.num_needed_tokens(100) == 100
    assert not SLIDING.persisted and SLIDING.expires and SLIDING.num_needed_tokens(100) == 7
    assert FULL.hit_start_block(10, BS) == 0
    # A hit of 10 blocks (40 tokens): the next query (position 40) sees keys 33..40, so the
    # sliding kind needs blocks 8 and 9 (tokens 32..39) and none before.
    assert SLIDING.hit_start_block(10, BS) == 8
    assert FULL.page_bytes(BS) == 2 * BS * 2 * 8 * 4 and FULL.tokens_per_block(BS) == BS
    assert FULL.signature(BS) != SLIDING.signature(BS)
    assert FullAttentionSpec(2, 8, torch.float32, torch.float8_e4m3fn).signature(BS) != FULL.signature(BS)


def test_pools_of_different_page_shapes():
    wide = FullAttentionSpec(4, 16, torch.float32)
    layout = KVLayout.from_specs([FULL, wide, FULL, wide, SLIDING], BS, torch.float32)
    pools = {g.pool_id for g in layout.groups}
    assert len(pools) == 2 and layout.num_pools == 2
    caches = layout.allocate(16, torch.device("cpu"))
    for layer, slot in enumerate(layout.layer_to_slot):
        spec = [FULL, wide, FULL, wide, SLIDING][layer]
        assert caches[slot][0].shape == (16 * BS, spec.num_kv_heads, spec.head_size)
    assert layout.bytes_per_block == sum(k.numel() * 4 * 2 for k, _ in caches) // 16
    manager = KVCacheManager(layout.groups, 16, BS)
    request = make_request("a", list(range(10)))
    run(manager, request)
    # Each group draws from its own pool: both pools hand out their own block ids.
    assert all(len(manager.pools[p].blocks_in_use()) > 0 for p in range(2))
    manager.free(request)
    assert manager.blocks_in_use() == {}


# ---------------------------------------------------------------------------------- retention
def test_window_blocks_wait_for_publishing_under_overlapped_scheduling():
    """The next step is scheduled while the prefill's is in flight: the window blocks it leaves
    behind stay until published, so a later request still finds its window (no replay)."""
    manager = hybrid(replay=8)
    first = make_request("a", list(range(40)))
    assert manager.allocate(first, 40, manager.find_prefix_hit(first))
    first.num_computed_tokens, first.num_tokens_in_flight = 40, 40   # the prefill, in flight
    first.append_output_token(7)
    assert manager.allocate(first, 1)               # the next step, scheduled before it lands
    sliding = next(g.group_id for g in manager.groups if g.spec.expires)
    assert NULL_BLOCK_ID not in first.block_ids[sliding][:10]
    first.num_tokens_in_flight = 0                  # the prefill's result applied
    manager.cache_computed_blocks(first)
    manager.free(first)
    hit = manager.find_prefix_hit(make_request("b", list(range(40)) + [1, 2, 3]))
    assert hit.num_computed_tokens == 40 and not hit.window_floor


def test_sliding_blocks_expire_after_retention_full_blocks_stay():
    clock = Clock()
    manager = hybrid(retention=180, clock=clock)
    first = make_request("a", list(range(20)))
    run(manager, first)
    manager.free(first)
    follow = list(range(20)) + [99, 98]
    clock.now = 179
    assert manager.find_prefix_hit(make_request("b", follow)).num_computed_tokens == 20
    clock.now = 181                                  # the sliding blocks' retention ran out
    hit = manager.find_prefix_hit(make_request("c", follow))
    assert hit.num_computed_tokens == 0              # no replay configured: exact means recompute
    sliding = manager.groups[0].group_id
    assert manager.counters[sliding].expirations > 0
    assert manager.counters[1].expirations == 0      # full blocks have no retention


def test_expired_sliding_blocks_are_reused_before_lru_blocks():
    clock = Clock()
    pool = BlockPool(num_blocks=4, num_groups=2, expiring_groups=frozenset({0}), retention_s=10, clock=clock)
    full_block, sliding_block, other = pool.allocate(3)
    pool.cache(1, full_block, b"f")
    pool.cache(0, sliding_block, b"s")
    pool.free([full_block])          # older: LRU would take it first
    clock.now = 1
    pool.free([sliding_block])
    clock.now = 20                   # the sliding block expired
    assert pool.allocate(1) == [sliding_block]
    assert pool.lookup(1, b"f") == full_block and pool.counters[0].expirations == 1
    assert pool.counters[1].evictions == 0


# ------------------------------------------------------------------------------------ replay
@pytest.mark.parametrize("full_kv", ["keep", "recompute"])
def test_replay_resumes_at_the_last_n_tokens(full_kv):
    clock = Clock()
    manager = hybrid(replay=8, full_kv=full_kv, retention=0, clock=clock)
    tables = first_turn(manager, clock)   # retention 0: the sliding blocks expire at once
    follow = make_request("b", list(range(40)) + [7, 7, 7])
    hit = manager.find_prefix_hit(follow)
    # The full group holds the 10 blocks (40 tokens); replay 8 tokens: resume at 32.
    assert hit.num_computed_tokens == 32 and hit.window_floor == 32
    sliding, full = manager.groups[0].group_id, manager.groups[1].group_id
    assert hit.block_ids[sliding] == [NULL_BLOCK_ID] * 8
    if full_kv == "keep":
        assert hit.block_ids[full] == tables[full][:10] and hit.write_floor == 40
    else:
        assert hit.block_ids[full] == tables[full][:8] and hit.write_floor == 0
    assert hit.num_replayed_tokens == (8 if full_kv == "keep" else 0)
    assert manager.allocate(follow, follow.num_tokens - 32, hit)
    assert len(follow.block_ids[sliding]) == len(follow.block_ids[full]) == 11
    assert NULL_BLOCK_ID not in follow.block_ids[sliding][8:]


def test_replay_off_means_exact_recompute_and_an_exact_hit_wins():
    clock = Clock()
    exact = hybrid(replay=0, retention=0, clock=clock)
    first_turn(exact, clock)
    assert exact.find_prefix_hit(make_request("b", list(range(40)) + [1])).num_computed_tokens == 0
    # With the sliding blocks still cached (long retention), the exact hit is taken: no replay.
    manager = hybrid(replay=8, retention=1e9, clock=clock)
    first_turn(manager)
    hit = manager.find_prefix_hit(make_request("b", list(range(40)) + [1]))
    assert hit.num_computed_tokens == 40 and hit.window_floor == 0 and hit.write_floor == 0


def test_replay_needs_a_full_attention_anchor():
    # Every layer sliding (Mistral-style): nothing outside the window is kept, so a lost window
    # means recomputing the prompt.
    clock = Clock()
    manager = KVCacheManager(group_layers([SLIDING, SLIDING]), 64, BS, replay=ReplayConfig(8),
                             swa_retention_s=0, clock=clock)
    first_turn(manager, clock)
    assert manager.find_prefix_hit(make_request("b", list(range(40)) + [1])).num_computed_tokens == 0


def test_replay_counters_count_replayed_tokens_not_as_hits():
    clock = Clock()
    manager = hybrid(replay=8, retention=0, clock=clock)
    first_turn(manager, clock)
    follow = make_request("b", list(range(40)) + [5])
    hit = manager.find_prefix_hit(follow)
    manager.record_prefix_query(follow.num_tokens, hit)
    sliding, full = manager.groups[0].group_id, manager.groups[1].group_id
    assert manager.counters[sliding].replayed == 8 and manager.counters[sliding].hits == 0
    assert manager.counters[full].hits == 40 and manager.counters[full].replayed == 0


def test_replay_default_is_the_window():
    groups = group_layers([SLIDING, FULL])
    assert replay_config(CacheConfig(), groups).num_tokens == 8
    assert replay_config(CacheConfig(swa_replay_tokens=0), groups).num_tokens == 0
    with pytest.raises(ValueError, match="swa_replay_tokens"):
        CacheConfig(swa_replay_tokens=-1)
    with pytest.raises(ValueError, match="swa_retention_s"):
        CacheConfig(swa_retention_s=float("nan"))
    with pytest.raises(ValueError, match="swa_replay_full_kv"):
        CacheConfig(swa_replay_full_kv="overwrite")


# ----------------------------------------------------------------------------- the hash root
def test_hash_root_separates_what_makes_bytes_differ():
    roots = {hash_root("m", None, 16, "auto"), hash_root("m", "rev2", 16, "auto"),
             hash_root("m", None, 32, "auto"), hash_root("m", None, 16, "fp8"),
             hash_root("m", None, 16, "auto", tp_rank=1), hash_root("other", None, 16, "auto")}
    assert len(roots) == 6
    manager = KVCacheManager(group_layers([FULL]), 32, BS)
    tokens = list(range(12))
    run(manager, make_request("a", tokens, root=hash_root("m", None, BS, "auto")))
    assert manager.find_prefix_hit(make_request("b", tokens, root=hash_root("m", None, BS, "fp8"))).num_computed_tokens == 0
    assert manager.find_prefix_hit(make_request("c", tokens, root=hash_root("m", None, BS, "auto"))).num_computed_tokens == 8
