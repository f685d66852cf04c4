"""The pool of KV block ids shared by all layer groups, with LRU eviction of cached blocks.

Block 0 is the null block: it pads block tables where a sliding-window group has freed blocks
that no query can see any more. It is never handed out and never freed.

A block is in one of three states:
  in use     ref_count > 0 (one or more requests point at it; shared prefix blocks count each)
  cached     ref_count == 0 and it has a hash: free, but its contents can still be hit
  empty      ref_count == 0 and no hash
Free blocks (cached or empty) sit in one queue. Allocation takes from the front; freeing puts
empty blocks at the front (worthless) and cached blocks at the back (evicted last, LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

NULL_BLOCK_ID = 0


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    # (group_id, hash) when the block holds a full, hashed block of tokens; else None.
    cache_key: tuple[int, bytes] | None = None


@dataclass
class GroupCounters:
    """Prefix-cache counters of one layer group (tokens for queries/hits, blocks for evictions)."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0


@dataclass
class BlockPool:
    num_blocks: int
    num_groups: int
    blocks: list[KVBlock] = field(init=False)
    counters: list[GroupCounters] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {self.num_blocks}")
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self.counters = [GroupCounters() for _ in range(self.num_groups)]
        # OrderedDict as an LRU queue of free block ids: O(1) append, pop-front and remove.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, self.num_blocks))
        self._cached: dict[tuple[int, bytes], int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of allocatable blocks in use (cached free blocks count as free)."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def blocks_in_use(self) -> dict[int, int]:
        """Block id -> reference count for every block outside the free queue (for leak checks)."""
        return {b.block_id: b.ref_count for b in self.blocks[1:] if b.block_id not in self._free}

    def allocate(self, n: int) -> list[int] | None:
        """Take n blocks (evicting cached ones, oldest first), or None if fewer are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.cache_key is not None:
                del self._cached[block.cache_key]
                self.counters[block.cache_key[0]].evictions += 1
                block.cache_key = None
            block.ref_count = 1
            out.append(block_id)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. Pass a request's blocks tail first, so that its
        last blocks (least likely to be shared) are evicted before its first ones."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.cache_key is None:
                    self._free.move_to_end(block_id, last=False)

    def lookup(self, group_id: int, block_hash: bytes) -> int | None:
        return self._cached.get((group_id, block_hash))

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks found by lookup (prefix hit)."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def cache(self, group_id: int, block_id: int, block_hash: bytes) -> None:
        """Register a full block's hash so later requests can hit it."""
        block = self.blocks[block_id]
        key = (group_id, block_hash)
        if block.cache_key is not None or key in self._cached:
            return  # already cached (e.g. computed twice by two requests at once): keep the first
        block.cache_key = key
        self._cached[key] = block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible when no block is in use."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.cache_key = None
        self._cached.clear()
        return True
