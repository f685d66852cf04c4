"""A pool of KV block ids (one per page shape), with LRU eviction and retention of cached blocks.

Block 0 is the null block: it pads block tables where a sliding-window group has freed blocks
that no query can see any more (or never rebuilt them, after SWA Bounded Replay). It is never
handed out and never freed.

A block is in one of three states:
  in use     ref_count > 0 (one or more requests point at it; shared prefix blocks count each)
  cached     ref_count == 0 and it has a hash: free, but its contents can still be hit
  empty      ref_count == 0 and no hash
Every block carries the time it was last used (taken or given back). Allocation takes empty
blocks first, then cached blocks of an expiring kind (sliding window) whose retention has run
out, then the least recently used cached block of any kind. An expired block is never hit: for
a sliding-window group that means its window is rebuilt by replay (kv_cache/manager.py).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer.types.block_tables import NULL_BLOCK_ID


class PoolEvents(Protocol):
    """What a pool tells the KV event stream (kv_cache/events.py KVEventSink implements it; the pool
    names only this, so the stream may read the pools without a cycle)."""

    def device_removed(self, group_id: int, block_hash: bytes) -> None: ...

    def device_cleared(self) -> None: ...


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    # (group_id, hash) when the block holds a full, hashed block of tokens; else None.
    cache_key: tuple[int, bytes] | None = None
    last_used: float = 0.0


@dataclass
class GroupCounters:
    """Prefix-cache counters of one layer group (tokens for queries, hits and replays; blocks
    for evictions, by cause)."""

    queries: int = 0
    hits: int = 0
    replayed: int = 0            # tokens recomputed to rebuild this group's window (SWA replay)
    evictions: int = 0           # cached blocks reused for other KV because the pool was full
    expirations: int = 0         # cached blocks dropped because their retention ran out


@dataclass
class BlockPool:
    num_blocks: int
    num_groups: int
    # Groups whose cached blocks expire `retention_s` after their last use (sliding window).
    expiring_groups: frozenset[int] = frozenset()
    retention_s: float = math.inf
    clock: Callable[[], float] = time.monotonic
    # Shared with the manager when several pools serve one model's groups.
    counters: list[GroupCounters] | None = None
    # KV events (kv_cache/events.py): told of every cached block dropped and of a reset; None: off.
    events: PoolEvents | None = None
    blocks: list[KVBlock] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {self.num_blocks}")
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        if self.counters is None:
            self.counters = [GroupCounters() for _ in range(self.num_groups)]
        # OrderedDicts as queues of free block ids: O(1) append, pop-front and remove. Cached
        # queues are in order of last use (a block is appended when it is given back).
        self._empty: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, self.num_blocks))
        self._cached_lru: OrderedDict[int, None] = OrderedDict()
        self._cached_expiring: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[tuple[int, bytes], int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._empty) + len(self._cached_lru) + len(self._cached_expiring)

    def usage(self) -> float:
        """Fraction of allocatable blocks in use (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def blocks_in_use(self) -> dict[int, int]:
        """Block id -> reference count for every block outside the free queues (for leak checks)."""
        return {b.block_id: b.ref_count for b in self.blocks[1:] if b.ref_count}

    # ------------------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int] | None:
        """Take n blocks (evicting cached ones as the order above says), or None if fewer are free."""
        if n > self.num_free_blocks:
            return None
        now = self.clock()
        out = []
        for _ in range(n):
            block = self.blocks[self._take_free(now)]
            if block.cache_key is not None:
                self._uncache(block, expired=self._is_expired(block, now))
            block.ref_count = 1
            block.last_used = now
            out.append(block.block_id)
        return out

    def _take_free(self, now: float) -> int:
        if self._empty:
            return self._empty.popitem(last=False)[0]
        expiring = next(iter(self._cached_expiring), None)
        lru = next(iter(self._cached_lru), None)
        if expiring is not None and (lru is None or self._is_expired(self.blocks[expiring], now)
                                     or self.blocks[expiring].last_used <= self.blocks[lru].last_used):
            return self._cached_expiring.popitem(last=False)[0]
        return self._cached_lru.popitem(last=False)[0]

    def _is_expired(self, block: KVBlock, now: float) -> bool:
        return (block.ref_count == 0 and block.cache_key is not None
                and block.cache_key[0] in self.expiring_groups and now - block.last_used >= self.retention_s)

    def _uncache(self, block: KVBlock, expired: bool) -> None:
        del self._cached[block.cache_key]
        counters = self.counters[block.cache_key[0]]
        if expired:
            counters.expirations += 1
        else:
            counters.evictions += 1
        if self.events is not None:
            self.events.device_removed(*block.cache_key)
        block.cache_key = None

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block. Pass a request's blocks tail first, so that its
        last blocks (least likely to be shared) are evicted before its first ones."""
        now = self.clock()
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                block.last_used = now
                self._free_queue(block)[block_id] = None

    def _free_queue(self, block: KVBlock) -> OrderedDict[int, None]:
        if block.cache_key is None:
            return self._empty
        return self._cached_expiring if block.cache_key[0] in self.expiring_groups else self._cached_lru

    # ---------------------------------------------------------------------------- prefix hits
    def lookup(self, group_id: int, block_hash: bytes) -> int | None:
        """The cached block holding this hash, unless its retention ran out (then it is dropped)."""
        block_id = self._cached.get((group_id, block_hash))
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if self._is_expired(block, self.clock()):
            del self._cached_expiring[block_id]
            self._uncache(block, expired=True)
            self._empty[block_id] = None
            return None
        return block_id

    def lookup_run(self, group_id: int, hashes: list[bytes], start: int, stop: int) -> list[int]:
        """The cached blocks of hashes[start:stop] up to the first that is not (lookup's rule).
        A kind that never expires needs no clock: the plain dictionary walk of a long prompt."""
        run: list[int] = []
        if group_id in self.expiring_groups:
            for block_hash in hashes[start:stop]:
                if (block_id := self.lookup(group_id, block_hash)) is None:
                    break
                run.append(block_id)
            return run
        cached = self._cached
        for block_hash in hashes[start:stop]:
            if (block_id := cached.get((group_id, block_hash))) is None:
                break
            run.append(block_id)
        return run

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference to cached blocks found by lookup (prefix hit)."""
        now = self.clock()
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_queue(block)[block_id]
            block.ref_count += 1
            block.last_used = now

    def cache(self, group_id: int, block_id: int, block_hash: bytes) -> None:
        """Register a full block's hash so later requests can hit it."""
        block = self.blocks[block_id]
        key = (group_id, block_hash)
        if block.cache_key is not None or key in self._cached:
            return  # already cached (e.g. computed twice by two requests at once): keep the first
        if block.ref_count == 0:   # a free block changes queue with its state
            del self._empty[block_id]
            block.cache_key = key
            self._free_queue(block)[block_id] = None
        block.cache_key = key
        self._cached[key] = block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.cache_key = None
        self._cached.clear()
        self._empty = OrderedDict((i, None) for i in range(1, self.num_blocks))
        self._cached_lru.clear()
        self._cached_expiring.clear()
        if self.events is not None:
            self.events.device_cleared()
        return True
