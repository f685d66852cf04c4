"""The KV manager: block tables per request and layer group, prefix hits, sliding-window frees.

The scheduler talks to it in verbs and gets block ids or a refusal, never tensors:
  find_prefix_hit(request)          -> (blocks per group, number of hit tokens)
  allocate(request, n, hit)         -> True, or False (nothing changed: preempt and retry)
  cache_computed_blocks(request)    after a step, publishes newly full blocks for reuse
  free(request)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from deepinfer.kv_cache.specs import FullAttentionSpec, KVCacheGroup

if TYPE_CHECKING:
    from deepinfer.engine.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, groups: list[KVCacheGroup], num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.groups = groups
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, len(groups))
        # No group frees blocks behind a window (_free_out_of_window has nothing to do).
        self._all_full_attention = all(type(g.spec) is FullAttentionSpec for g in groups)

    # ----------------------------------------------------------------------------- prefix hits
    def find_prefix_hit(self, request: Request) -> tuple[list[list[int]], int]:
        """The longest cached prefix valid in every group, in whole blocks.

        At least one token is always left to compute: the step that computes it yields the
        logits for the first sampled token.
        """
        empty: list[list[int]] = [[] for _ in self.groups]
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return empty, 0
        bs = self.block_size
        hashes = request.block_hashes
        max_blocks = min(len(hashes), (request.num_tokens - 1) // bs)
        cached = [[self.pool.lookup(g.group_id, h) for h in hashes[:max_blocks]] for g in self.groups]
        for n in range(max_blocks, 0, -1):
            hit: list[list[int]] = []
            for group, ids in zip(self.groups, cached):
                first = (n * bs - group.spec.num_needed_tokens(n * bs)) // bs
                if any(block_id is None for block_id in ids[first:n]):
                    break
                hit.append([NULL_BLOCK_ID] * first + ids[first:n])  # type: ignore[list-item]
            else:
                return hit, n * bs
        return empty, 0

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        for counters in self.pool.counters:
            counters.queries += num_tokens
            counters.hits += num_hit_tokens

    # ------------------------------------------------------------------------------ allocation
    def allocate(self, request: Request, num_new_tokens: int,
                 hit_blocks: list[list[int]] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens of KV (after any hit). All or nothing."""
        bs = self.block_size
        if not request.block_ids:
            request.block_ids = [[] for _ in self.groups]
        elif hit_blocks is None and self._all_full_attention:
            # The common case, a decode within its last block: nothing to free or allocate.
            # (The general path below costs host time per running request per step:
            # docs/benchmarks/design-measurements.md#kv-allocate-fast-path)
            blocks = _cdiv(request.num_computed_tokens + num_new_tokens, bs)
            if all(len(ids) >= blocks for ids in request.block_ids):
                return True
        if hit_blocks is not None:
            assert all(not ids for ids in request.block_ids), "hits only apply to a fresh request"
        self._free_out_of_window(request)
        total_tokens = request.num_computed_tokens + num_new_tokens
        if hit_blocks is not None:
            total_tokens += len(hit_blocks[0]) * bs
        hit_free = 0  # hit blocks that sit in the free queue and will leave it when touched
        needed = 0
        for g, ids in enumerate(request.block_ids):
            have = len(ids) + (len(hit_blocks[g]) if hit_blocks else 0)
            needed += max(0, _cdiv(total_tokens, bs) - have)
            if hit_blocks:
                hit_free += sum(1 for b in hit_blocks[g]
                                if b != NULL_BLOCK_ID and self.pool.blocks[b].ref_count == 0)
        if needed + hit_free > self.pool.num_free_blocks:
            return False
        if hit_blocks:
            for g, ids in enumerate(hit_blocks):
                self.pool.touch(ids)
                request.block_ids[g].extend(ids)
        for ids in request.block_ids:
            missing = _cdiv(total_tokens, bs) - len(ids)
            if missing > 0:
                new = self.pool.allocate(missing)
                assert new is not None  # checked above
                ids.extend(new)
        return True

    def _free_out_of_window(self, request: Request) -> None:
        """Sliding-window groups: give back blocks no future query can attend to."""
        bs = self.block_size
        computed = request.num_computed_tokens
        for group, ids in zip(self.groups, request.block_ids):
            first_needed = (computed - group.spec.num_needed_tokens(computed)) // bs
            for i in range(min(first_needed, len(ids))):
                if ids[i] != NULL_BLOCK_ID:
                    self.pool.free([ids[i]])
                    ids[i] = NULL_BLOCK_ID

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the hashes of blocks that became full and computed in the last step."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return
        # Only blocks whose KV a finished step wrote: with overlapped scheduling the next step
        # is already scheduled, and it may yet be dropped (its request finished).
        hashes = request.block_hashes
        num_full = min(request.num_kv_ready_tokens // self.block_size, len(hashes))
        for g, ids in enumerate(request.block_ids):
            for i in range(request.num_published_blocks, num_full):
                if ids[i] != NULL_BLOCK_ID:
                    self.pool.cache(g, ids[i], hashes[i])
        request.num_published_blocks = max(request.num_published_blocks, num_full)

    def free_tail(self, request: Request) -> None:
        """Give back blocks past the request's known tokens: they held KV of rejected drafts.

        The next step computes the last known token, so cdiv(num_tokens, block_size) blocks stay.
        Tail blocks were never published (only computed, accepted tokens are), so they go to the
        front of the free queue as empty blocks.
        """
        keep = _cdiv(request.num_tokens, self.block_size)
        for ids in request.block_ids:
            if len(ids) > keep:
                self.pool.free(ids[keep:][::-1])
                del ids[keep:]

    def free(self, request: Request) -> None:
        for ids in request.block_ids:
            self.pool.free(ids[::-1])
        request.block_ids = [[] for _ in self.groups]
        request.num_published_blocks = 0

    def usage(self) -> float:
        return self.pool.usage()
