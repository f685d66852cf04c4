"""What each attention layer keeps in the KV cache, and how layers are grouped.

Layers are grouped by KV kind. Every group has its own block table per request, but all groups
draw block ids from one shared pool. The physical cache is a small number of "slots" (one KV
tensor each, `num_blocks` pages deep); the i-th layer of every group uses slot i. A block id is
owned by exactly one group at a time, so layers of different groups that share a slot never
touch the same page. Splitting big kinds into groups of equal size keeps the number of slots
(and so the memory per block id) at the size of the smallest kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FullAttentionSpec:
    """Every token's K and V are kept for the whole life of the request."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype                      # K/V as the model computes them
    cache_dtype: torch.dtype | None = None  # as the cache stores them (kv_cache_dtype); None: dtype

    kind = "full"

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.cache_dtype or self.dtype

    def page_bytes(self, block_size: int) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_size * self.storage_dtype.itemsize

    def num_needed_tokens(self, num_tokens: int) -> int:
        """How many of the most recent tokens later queries can still attend to."""
        return num_tokens


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Only the last `sliding_window` tokens are attended to; older blocks are freed."""

    sliding_window: int = 0

    kind = "sliding_window"

    def num_needed_tokens(self, num_tokens: int) -> int:
        # A query at position p sees keys (p - window, p]; the next query is at num_tokens.
        return min(num_tokens, self.sliding_window - 1)


KVCacheSpec = FullAttentionSpec  # the base type every spec derives from
# DeepSeek-V4 adds a compressed kind (rows every 4 or 128 tokens plus compressor state); it
# plugs in as another spec with its own page size and its own num_needed_tokens rule.


@dataclass(frozen=True)
class KVCacheGroup:
    group_id: int
    spec: KVCacheSpec
    layer_ids: tuple[int, ...]  # the model's layer indices in this group; layer_ids[i] uses slot i


def group_layers(specs: list[KVCacheSpec]) -> list[KVCacheGroup]:
    """Group layers with identical specs, splitting big kinds into groups of the smallest size."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer_id, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer_id)
    page_sizes = {(s.num_kv_heads, s.head_size, s.storage_dtype) for s in by_spec}
    if len(page_sizes) != 1:
        raise NotImplementedError(
            "layers with different KV page shapes need separate pools; not supported yet: "
            f"{sorted(map(str, page_sizes))}")
    group_size = min(len(layers) for layers in by_spec.values())
    groups: list[KVCacheGroup] = []
    for spec, layers in by_spec.items():
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroup(len(groups), spec, tuple(layers[start:start + group_size])))
    return groups


def num_slots(groups: list[KVCacheGroup]) -> int:
    return max(len(g.layer_ids) for g in groups)
