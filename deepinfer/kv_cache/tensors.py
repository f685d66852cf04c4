"""The KV tensors: the layout of layers onto pools and slots, and their allocation.

Every pool (specs.py: one per page shape) holds its number of pages per slot: `num_blocks`, but a
pool whose kinds all keep a bounded number of tokens per request (DeepSeek-V4's sliding windows,
in a pool of their own) only what max_num_seqs requests and one batch's chunk need, twice over
(for blocks cached past their request): its memory does not grow with the context. The tensors of all
pools are one flat list of (K, V) pairs, pool after pool, each [num_blocks * rows per block
(block_size, or a compressed kind's rows and state), kv_heads, head_dim], K and V one tensor
for a kind with shared_kv; `layer_to_slot[layer]` indexes that list, so attention backends address a
layer's cache the same way whatever the pools are. Block ids are per pool (a group's table holds
ids of its own pool); every pool reserves block 0 as its null block.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deepinfer.kv_cache.specs import KVCacheGroup, KVCacheSpec, group_layers, num_pools, num_slots


def pool_slot_offsets(groups: list[KVCacheGroup]) -> list[int]:
    """Where each pool's slots start in the flat list of (K, V) tensors."""
    offsets = [0]
    for pool in range(num_pools(groups) - 1):
        offsets.append(offsets[-1] + num_slots(groups, pool))
    return offsets


def group_slots(groups: list[KVCacheGroup], group: KVCacheGroup) -> list[int]:
    """The flat (K, V) indices of a group's layers, in layer order (what a tier copies)."""
    start = pool_slot_offsets(groups)[group.pool_id]
    return list(range(start, start + len(group.layer_ids)))


@dataclass(frozen=True)
class KVLayout:
    groups: list[KVCacheGroup]
    block_size: int
    layer_to_group: list[int]
    layer_to_slot: list[int]      # index into the flat list of (K, V) tensors
    pool_slot_offsets: list[int]  # where each pool's slots start in that list

    @classmethod
    def from_specs(cls, specs: list[KVCacheSpec], block_size: int, cache_dtype: torch.dtype) -> KVLayout:
        specs = [dataclasses.replace(s, cache_dtype=cache_dtype) for s in specs]
        groups = group_layers(specs)
        layer_to_group, layer_to_slot = [0] * len(specs), [0] * len(specs)
        for g in groups:
            for slot, layer in zip(group_slots(groups, g), g.layer_ids):
                layer_to_group[layer], layer_to_slot[layer] = g.group_id, slot
        return cls(groups, block_size, layer_to_group, layer_to_slot, pool_slot_offsets(groups))

    @property
    def num_pools(self) -> int:
        return len(self.pool_slot_offsets)

    def pool_spec(self, pool_id: int) -> KVCacheSpec:
        """A spec of the pool (all of its groups share the page shape)."""
        return next(g.spec for g in self.groups if g.pool_id == pool_id)

    def pool_bytes_per_block(self, pool_id: int) -> int:
        """Device bytes one block id of a pool costs: a page in every slot of the pool."""
        return num_slots(self.groups, pool_id) * self.pool_spec(pool_id).page_bytes(self.block_size)

    @property
    def bytes_per_block(self) -> int:
        """Device bytes one block id costs in every pool together."""
        return sum(self.pool_bytes_per_block(p) for p in range(self.num_pools))

    def bounded_pools(self, max_model_len: int) -> list[bool]:
        """Per pool: whether its kinds keep fewer tokens than a whole request (all windows). With
        no unbounded pool at all (every layer windowed) none counts as bounded: the main pool."""
        bounded = [all(g.spec.num_needed_tokens(max_model_len) < max_model_len for g in self.groups
                       if g.pool_id == p) for p in range(self.num_pools)]
        return bounded if not all(bounded) else [False] * self.num_pools

    def pool_blocks(self, num_blocks: int, bounded_blocks: int, max_model_len: int) -> list[int]:
        """Block ids per pool: `num_blocks`, bounded pools min(bounded_blocks, num_blocks)."""
        return [min(bounded_blocks, num_blocks) if b else num_blocks for b in self.bounded_pools(max_model_len)]

    def total_bytes(self, pool_blocks: list[int]) -> int:
        return sum(n * self.pool_bytes_per_block(p) for p, n in enumerate(pool_blocks))

    def allocate(self, num_blocks: int | list[int], device: torch.device, *,
                 share_kv: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed (K, V) tensors for every slot of every pool, `num_blocks` pages per slot (one
        count for all pools, or one per pool). `share_kv`: K and V are one tensor, for
        throwaway caches nothing reads back (profiling and warm-up steps)."""
        counts = num_blocks if isinstance(num_blocks, list) else [num_blocks] * self.num_pools
        caches = []
        for pool in range(self.num_pools):
            spec = self.pool_spec(pool)
            for _ in range(num_slots(self.groups, pool)):
                shape = (counts[pool] * spec.rows_per_block(self.block_size), spec.num_kv_heads, spec.head_size)
                if share_kv or spec.shared_kv:
                    k = torch.zeros(shape, dtype=spec.storage_dtype, device=device)
                    caches.append((k, k))
                elif device.type == "cpu":
                    # K then V in one allocation: the CPU decode attention gathers both rows of a
                    # position in one index_select (attention/cpu_decode.py, kv_paired).
                    pair = torch.zeros((2, *shape), dtype=spec.storage_dtype, device=device)
                    caches.append((pair[0], pair[1]))
                else:
                    k = torch.zeros(shape, dtype=spec.storage_dtype, device=device)
                    caches.append((k, torch.zeros_like(k)))
        return caches
