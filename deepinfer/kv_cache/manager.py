"""The KV manager: block tables per request and layer group, prefix hits, sliding-window frees.

The scheduler talks to it in verbs and gets block ids or a refusal, never tensors:
  find_prefix_hit(request)          -> PrefixHit: per group what is cached, and where to resume
  allocate(request, n, hit)         -> True, or False (nothing changed: preempt and retry)
  cache_computed_blocks(request)    after a step, publishes newly full blocks for reuse
  free(request)

A prefix hit is decided per group by its kind's rule (specs.py) and then combined:
  exact    the longest prefix every group holds as its kind needs it (a sliding-window group
           only the blocks of its last window): nothing is recomputed.
  replay   SWA Bounded Replay. The full-attention groups hold a longer prefix, but the
           sliding-window groups lost its last window (it expired, swa_retention_s, or was
           evicted). Then only the last `swa_replay_tokens` tokens of that prefix are recomputed,
           from `window_floor` on; sliding-window layers attend only inside the recomputed
           segment, so its cost is a constant whatever the context length. The rebuilt window is
           an approximation of the exact one, not bit-exact. The full-attention KV of the
           replayed positions is either kept (swa_replay_full_kv="keep": the cached rows stay, the
           forward writes none below `write_floor`) or recomputed ("recompute": those groups hit
           only up to the floor, and write fresh blocks).
  The better of the two (more tokens not to compute) wins. `swa_replay_tokens=0` turns replay off.
Replayed tokens are tokens to compute: the scheduler's one rule (num_computed_tokens) is unchanged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool, GroupCounters
from deepinfer.kv_cache.specs import KVCacheGroup, num_pools, sliding_window_of
from deepinfer.types.block_hashes import ROOT_HASH

if TYPE_CHECKING:
    from deepinfer.types.request import Request


# A KV tier's look-up: (the request's block hashes, blocks the device holds) -> more blocks it holds.
TierLookup = Callable[[list[bytes], int], int]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixHit:
    """What a request can take from the cache, per group, and where its computing starts."""

    block_ids: list[list[int]]      # per group: cached blocks to take (null where none is needed)
    num_computed_tokens: int = 0    # the resume point: tokens [0, it) need no compute
    window_floor: int = 0           # replay: sliding-window layers see no key below it
    write_floor: int = 0            # replay, "keep": full-attention layers write no KV below it
    group_hit_tokens: list[int] = field(default_factory=list)   # per group, for the counters
    # Blocks [load_start, load_start + num_load_blocks) of the persisted (full-attention) groups
    # come from a KV tier: allocate() gives them fresh device blocks, which a load then fills.
    load_start: int = 0
    num_load_blocks: int = 0
    num_tier_queried_blocks: int = 0   # blocks asked of the tier (past the device's), for its counters

    @property
    def num_replayed_tokens(self) -> int:
        """Tokens of the cached prefix computed again to rebuild sliding windows."""
        return max(self.group_hit_tokens, default=0) - self.num_computed_tokens if self.window_floor else 0


@dataclass(frozen=True)
class ReplayConfig:
    """SWA Bounded Replay's knobs (CacheConfig: swa_replay_tokens, swa_replay_full_kv)."""

    num_tokens: int = 0             # 0: exact (no replay)
    full_kv: str = "keep"           # "keep" | "recompute"


def replay_config(cache, groups: list[KVCacheGroup]) -> ReplayConfig:
    """The replay knobs of a CacheConfig; swa_replay_tokens unset means the model's (largest) window."""
    windows = [w for g in groups if (w := sliding_window_of(g.spec))]
    num_tokens = cache.swa_replay_tokens if cache.swa_replay_tokens is not None else max(windows, default=0)
    return ReplayConfig(num_tokens, cache.swa_replay_full_kv)


class _GroupLookups:
    """One group's cached blocks for a request's block hashes, each looked up on first need: a
    long prompt's sliding-window groups are asked only about their last window."""

    def __init__(self, pool: BlockPool, group_id: int, hashes: list[bytes]) -> None:
        self._pool, self._group_id, self._hashes = pool, group_id, hashes
        self._found: dict[int, int | None] = {}
        self._run: list[int] = []     # blocks known cached from the start
        self._run_ended = False       # the block after the run is known not to be

    def __getitem__(self, i: int) -> int | None:
        if i < len(self._run):
            return self._run[i]
        if i not in self._found:
            self._found[i] = self._pool.lookup(self._group_id, self._hashes[i])
        return self._found[i]

    def prefix(self, stop: int) -> int:
        """How many of blocks [0, stop) are cached without a gap from the start."""
        if not self._run_ended and len(self._run) < stop:
            more = self._pool.lookup_run(self._group_id, self._hashes, len(self._run), stop)
            self._run += more
            self._run_ended = len(self._run) < stop
        return min(len(self._run), stop)

    def last_miss(self, start: int, stop: int) -> int | None:
        """The last block of [start, stop) that is not cached, or None."""
        return next((i for i in range(stop - 1, start - 1, -1) if self[i] is None), None)

    def blocks(self, start: int, stop: int) -> list[int]:
        """Cached block ids [start, stop) (the caller knows they are all cached)."""
        if stop <= len(self._run):
            return self._run[start:stop]
        return [self[i] for i in range(start, stop)]   # type: ignore[misc]


class KVCacheManager:
    def __init__(self, groups: list[KVCacheGroup], num_blocks: int | list[int], block_size: int,
                 enable_prefix_caching: bool = True, *, replay: ReplayConfig | None = None,
                 swa_retention_s: float = math.inf, clock: Callable[[], float] = time.monotonic,
                 hash_root: bytes = ROOT_HASH) -> None:
        self.groups = groups
        self.hash_root = hash_root
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.replay = replay or ReplayConfig()
        self.counters = [GroupCounters() for _ in groups]
        self.request_counters = GroupCounters()   # per request: queried tokens, tokens not computed
        expiring = frozenset(g.group_id for g in groups if g.spec.expires)
        counts = num_blocks if isinstance(num_blocks, list) else [num_blocks] * num_pools(groups)
        self.pools = [BlockPool(n, len(groups), expiring, swa_retention_s, clock, self.counters) for n in counts]
        # Groups that anchor a replay: kinds that keep every token (full attention).
        self._anchors = [g for g in groups if not g.spec.expires and g.spec.hit_start_block(1, block_size) == 0]
        # Groups whose kind keeps every token (no window): all of a hit's blocks must be cached.
        self._keeps_all = [g for g in groups if g.spec.num_needed_tokens(1 << 30) == 1 << 30]
        # No group frees blocks behind a window (_free_out_of_window has nothing to do).
        self._all_full_attention = len(self._keeps_all) == len(groups)

    @property
    def pool(self) -> BlockPool:
        """The first pool (the only one unless layers have several page shapes)."""
        return self.pools[0]

    def pool_of(self, group: KVCacheGroup) -> BlockPool:
        return self.pools[group.pool_id]

    def blocks_in_use(self) -> dict[tuple[int, int], int]:
        """(pool, block id) -> references, for leak checks."""
        return {(p, b): refs for p, pool in enumerate(self.pools) for b, refs in pool.blocks_in_use().items()}

    # ----------------------------------------------------------------------------- prefix hits
    def find_prefix_hit(self, request: Request, tier_blocks: TierLookup | None = None) -> PrefixHit:
        """The cached prefix of a request, in whole blocks, exact or by replay (module doc).

        `tier_blocks(hashes, n)`: how many blocks past the first n a KV tier holds for the
        persisted groups (None: no tier). They extend the full-attention prefix; the
        sliding-window groups, never in a tier, are then rebuilt by replay.
        At least one token is always left to compute: the step that computes it yields the
        logits for the first sampled token.
        """
        miss = PrefixHit([[] for _ in self.groups], group_hit_tokens=[0] * len(self.groups))
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return miss
        bs = self.block_size
        hashes = request.block_hashes
        max_blocks = min(len(hashes), (request.num_tokens - 1) // bs)
        cached = [_GroupLookups(self.pool_of(g), g.group_id, hashes) for g in self.groups]
        on_device = min((cached[g.group_id].prefix(max_blocks) for g in self._anchors), default=0)
        asked = max_blocks - on_device if tier_blocks is not None else 0
        from_tier = tier_blocks(hashes[:max_blocks], on_device) if asked else 0
        if from_tier and len(self._anchors) == len(self.groups):   # every kind is in the tier
            covered = on_device + from_tier
            hit = PrefixHit([ids.blocks(0, on_device) for ids in cached], covered * bs,   # type: ignore[misc]
                            group_hit_tokens=[covered * bs] * len(self.groups), load_start=on_device,
                            num_load_blocks=from_tier)
        else:
            # An exact hit wins unless the replay resumes later, so it is searched no shorter
            # than the replay's resume point: with replay on, the windowed kinds are asked about
            # a few blocks whatever the prompt's length.
            replay = self._replay_hit(cached, on_device + from_tier, on_device)
            shortest = replay.num_computed_tokens // bs if replay is not None else 1
            exact = self._exact_hit(cached, max_blocks, shortest)
            hit = exact or replay or miss
        hit.num_tier_queried_blocks = asked
        return hit

    def _exact_hit(self, cached: list[_GroupLookups], max_blocks: int, shortest: int) -> PrefixHit | None:
        """The longest prefix of at least `shortest` blocks every group holds as its kind needs."""
        bs = self.block_size
        # Kinds that need every block bound the hit by their first missing block. Then, from that
        # length down, each windowed kind is asked only about its last window: a miss at block j
        # rules out every length from j + 1 to the one asked (hit_start_block grows with the
        # length), so the next candidate is the smallest such j. Lookups stay linear in the
        # prompt's blocks, and a long prompt's old windows are never looked at.
        n = min((ids.prefix(max_blocks) for g, ids in zip(self.groups, cached) if g in self._keeps_all),
                default=max_blocks)
        windowed = [(g, ids) for g, ids in zip(self.groups, cached) if g not in self._keeps_all]
        while n >= max(shortest, 1):
            misses = [j for g, ids in windowed if (j := ids.last_miss(g.spec.hit_start_block(n, bs), n)) is not None]
            if not misses:
                hit = [[NULL_BLOCK_ID] * (first := group.spec.hit_start_block(n, bs)) + ids.blocks(first, n)
                       for group, ids in zip(self.groups, cached)]
                return PrefixHit(hit, n * bs, group_hit_tokens=[n * bs] * len(self.groups))  # type: ignore[arg-type]
            n = min(misses)
        return None

    def _replay_hit(self, cached: list[_GroupLookups], covered: int, on_device: int) -> PrefixHit | None:
        """Resume `swa_replay_tokens` before the end of the anchors' prefix of `covered` blocks,
        the first `on_device` of them on the device and the rest in a tier (module doc)."""
        if not self.replay.num_tokens or not self._anchors or len(self._anchors) == len(self.groups):
            return None
        bs = self.block_size
        floor = max(covered * bs - self.replay.num_tokens, 0) // bs   # in blocks, rounded down
        if floor == 0:
            return None
        keep = self.replay.full_kv == "keep"
        needed = covered if keep else floor   # blocks the anchors take (device, then tier)
        blocks, hits = [], []
        for group, ids in zip(self.groups, cached):
            if group in self._anchors:
                blocks.append(ids.blocks(0, min(needed, on_device)))
                hits.append(needed * bs)
            else:   # rebuilt from the floor on; nothing before it is read (window_floor)
                blocks.append([NULL_BLOCK_ID] * floor)
                hits.append(0)
        return PrefixHit(blocks, floor * bs, window_floor=floor * bs, write_floor=covered * bs if keep else 0,
                         group_hit_tokens=hits, load_start=on_device, num_load_blocks=max(needed - on_device, 0))

    def record_prefix_query(self, num_tokens: int, hit: PrefixHit) -> None:
        self.request_counters.queries += num_tokens
        self.request_counters.hits += hit.num_computed_tokens
        replayed = hit.num_replayed_tokens
        for group, counters, hit_tokens in zip(self.groups, self.counters, hit.group_hit_tokens):
            counters.queries += num_tokens
            counters.hits += hit_tokens
            if group.spec.expires:
                counters.replayed += replayed

    # ------------------------------------------------------------------------------ allocation
    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens of KV (after any hit, from its resume
        point). All or nothing."""
        bs = self.block_size
        if not request.block_ids:
            request.block_ids = [[] for _ in self.groups]
        elif hit is None and self._all_full_attention:
            # The common case, a decode within its last block: nothing to free or allocate.
            # (The general path below costs host time per running request per step:
            # docs/benchmarks/design-measurements.md#kv-allocate-fast-path)
            blocks = _cdiv(request.num_computed_tokens + num_new_tokens, bs)
            if all(len(ids) >= blocks for ids in request.block_ids):
                return True
        if hit is not None:
            assert all(not ids for ids in request.block_ids), "hits only apply to a fresh request"
        self._free_out_of_window(request)
        start = hit.num_computed_tokens if hit is not None else request.num_computed_tokens
        total_blocks = _cdiv(start + num_new_tokens, bs)
        needed = [0] * len(self.pools)
        hit_free = [0] * len(self.pools)   # hit blocks in a free queue, leaving it when touched
        for g, (group, ids) in enumerate(zip(self.groups, request.block_ids)):
            pool = self.pool_of(group)
            taken = hit.block_ids[g] if hit is not None else []
            needed[group.pool_id] += max(0, total_blocks - len(ids) - len(taken))
            hit_free[group.pool_id] += sum(1 for b in taken if b != NULL_BLOCK_ID and pool.blocks[b].ref_count == 0)
        if any(n + f > pool.num_free_blocks for n, f, pool in zip(needed, hit_free, self.pools)):
            return False
        for g, (group, ids) in enumerate(zip(self.groups, request.block_ids)):
            pool = self.pool_of(group)
            if hit is not None:
                pool.touch(hit.block_ids[g])
                ids.extend(hit.block_ids[g])
            missing = total_blocks - len(ids)
            if missing > 0:
                new = pool.allocate(missing)
                assert new is not None  # checked above
                ids.extend(new)
        return True

    def _free_out_of_window(self, request: Request) -> None:
        """Sliding-window groups: give back blocks no future query can attend to.

        With prefix caching, only blocks already published: with overlapped scheduling the
        step that computed a block may still be in flight when the next one is scheduled, and
        a block freed before cache_computed_blocks saw it would leave the cache unhashed (later
        requests would lose its window, and replay). It goes back at the next allocation."""
        bs = self.block_size
        computed = request.num_computed_tokens
        caching = self.enable_prefix_caching and not request.skip_prefix_cache
        limit = request.num_published_blocks if caching else computed // bs
        for group, ids in zip(self.groups, request.block_ids):
            first_needed = (computed - group.spec.num_needed_tokens(computed)) // bs
            pool = self.pool_of(group)
            for i in range(min(first_needed, len(ids), limit)):
                if ids[i] != NULL_BLOCK_ID:
                    pool.free([ids[i]])
                    ids[i] = NULL_BLOCK_ID

    def cache_computed_blocks(self, request: Request) -> range:
        """Publish the hashes of blocks that became full and computed in the last step; returns
        the block indices published now (what a KV tier may save)."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return range(0)
        # Only blocks whose KV a finished step wrote: with overlapped scheduling the next step
        # is already scheduled, and it may yet be dropped (its request finished).
        hashes = request.block_hashes
        num_full = min(request.num_kv_ready_tokens // self.block_size, len(hashes))
        for group, ids in zip(self.groups, request.block_ids):
            pool = self.pool_of(group)
            for i in range(request.num_published_blocks, num_full):
                if ids[i] != NULL_BLOCK_ID:
                    pool.cache(group.group_id, ids[i], hashes[i])
        published = range(request.num_published_blocks, num_full)
        request.num_published_blocks = max(request.num_published_blocks, num_full)
        return published

    def free_tail(self, request: Request) -> None:
        """Give back blocks past the request's known tokens: they held KV of rejected drafts.

        The next step computes the last known token, so cdiv(num_tokens, block_size) blocks stay.
        Tail blocks were never published (only computed, accepted tokens are), so they go back
        as empty blocks.
        """
        keep = _cdiv(request.num_tokens, self.block_size)
        for group, ids in zip(self.groups, request.block_ids):
            if len(ids) > keep:
                self.pool_of(group).free(ids[keep:][::-1])
                del ids[keep:]

    def free(self, request: Request) -> None:
        for group, ids in zip(self.groups, request.block_ids):
            self.pool_of(group).free(ids[::-1])
        request.block_ids = [[] for _ in self.groups]
        request.num_published_blocks = 0

    def usage(self) -> float:
        return max(pool.usage() for pool in self.pools)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, in every pool; only possible when no block is in use."""
        if self.blocks_in_use():
            return False
        return all([pool.reset_prefix_cache() for pool in self.pools])
