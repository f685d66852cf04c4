"""What each attention layer keeps in the KV cache (its kind, as a policy object), and how layers
are grouped and laid out in pools.

A kind is one `KVCacheSpec` subclass. It owns every rule that differs between kinds, so the
manager never asks which kind it holds:
  page_bytes / tokens_per_block   how big one block is, and how many token positions it covers
  num_needed_tokens               which recent tokens later queries can still attend to (older
                                  blocks go back to the pool)
  hit_start_block                 the first block a prefix hit of n blocks must find cached
  persisted                       whether a tier outside the device may keep its blocks
  expires                         whether its cached blocks have a retention (swa_retention_s)
  rows_per_block                  how many cache rows one block's page holds
DeepSeek-V4's compressed kind (CompressedSpec: one row every `rate` tokens, plus the compressor
state a prefix hit at the block's end resumes from) is the third. A kind whose key and value
are one tensor (`shared_kv`: V4's single K=V head, its compressed rows, its indexer keys) stores
one tensor per layer instead of two.

Layers are grouped by spec. Every group has its own block table per request. Groups whose pages
have the same shape share one pool of block ids and one set of KV tensors ("slots", one per
layer position in the group): the i-th layer of every group in a pool uses the pool's slot i, and
a block id is owned by one group at a time, so layers of different groups that share a slot
never touch the same page. Splitting big kinds into groups of equal size keeps the number of
slots of a pool at the size of its smallest kind. Groups with another page shape get a pool of
their own (kv_cache/tensors.py allocates each pool's tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """The base of every kind: K and V rows of `num_kv_heads` x `head_size` per token."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype                      # K/V as the model computes them
    cache_dtype: torch.dtype | None = None  # as the cache stores them (kv_cache_dtype); None: dtype
    shared_kv: bool = False                 # K and V are one tensor (one row per token, not two)

    kind: ClassVar[str] = "base"
    persisted: ClassVar[bool] = True        # a KV tier (connector) may store its blocks
    expires: ClassVar[bool] = False         # cached blocks are dropped after swa_retention_s

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.cache_dtype or self.dtype

    @property
    def page_shape(self) -> tuple:
        """What two specs must share to live in one pool (their tensors are alike)."""
        return (self.num_kv_heads, self.head_size, self.storage_dtype, self.shared_kv)

    def tokens_per_block(self, block_size: int) -> int:
        return block_size

    def rows_per_block(self, block_size: int) -> int:
        """Cache rows (of num_kv_heads x head_size) in one block's page: one per token here."""
        return block_size

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block of one layer (K and V, or the one shared tensor)."""
        tensors = 1 if self.shared_kv else 2
        return tensors * self.rows_per_block(block_size) * self.num_kv_heads * self.head_size * self.storage_dtype.itemsize

    def num_needed_tokens(self, num_tokens: int) -> int:
        """How many of the most recent tokens later queries can still attend to."""
        return num_tokens

    def hit_start_block(self, num_hit_blocks: int, block_size: int) -> int:
        """The first of a prefix hit's blocks this kind needs cached: the ones before it no
        query after the hit attends to (they become the null block in its table)."""
        num_tokens = num_hit_blocks * block_size
        return (num_tokens - self.num_needed_tokens(num_tokens)) // block_size

    def signature(self, block_size: int) -> str:
        """Everything that makes this kind's bytes differ, for keys outside the device."""
        dtype = str(self.storage_dtype).removeprefix("torch.")
        shared = ":kv1" if self.shared_kv else ""
        return f"{self.kind}:{self.num_kv_heads}x{self.head_size}:{dtype}:bs{block_size}{shared}"


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token's K and V are kept for the whole life of the request."""

    kind: ClassVar[str] = "full"


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Only the last `sliding_window` tokens are attended to; older blocks are freed. Its KV is
    never persisted outside the device and its cached blocks expire: a later hit rebuilds the
    window by SWA Bounded Replay (kv_cache/manager.py)."""

    sliding_window: int = 0

    kind: ClassVar[str] = "sliding_window"
    persisted: ClassVar[bool] = False
    expires: ClassVar[bool] = True

    def num_needed_tokens(self, num_tokens: int) -> int:
        # A query at position p sees keys (p - window, p]; the next query is at num_tokens.
        return min(num_tokens, self.sliding_window - 1)

    def signature(self, block_size: int) -> str:
        return f"{super().signature(block_size)}:w{self.sliding_window}"


@dataclass(frozen=True)
class CompressedSpec(KVCacheSpec):
    """DeepSeek-V4's compressed KV: one row (num_kv_heads x head_size) per `rate` tokens, kept
    for the whole request like full attention. A block of block_size tokens holds block_size /
    rate rows, then `tail_rows` rows of state: what the compressor carries across the block's
    end (models/deepseek_v4/paged.py), so that a prefix hit ending there resumes exactly."""

    rate: int = 1
    tail_rows: int = 0

    kind: ClassVar[str] = "compressed"

    @property
    def page_shape(self) -> tuple:
        return (*super().page_shape, self.rate, self.tail_rows)

    def rows_per_block(self, block_size: int) -> int:
        if block_size % self.rate:
            raise ValueError(f"block_size {block_size} is not a multiple of the compress rate {self.rate}")
        return block_size // self.rate + self.tail_rows

    def signature(self, block_size: int) -> str:
        return f"{super().signature(block_size)}:r{self.rate}t{self.tail_rows}"


@dataclass(frozen=True)
class KVCacheGroup:
    group_id: int
    spec: KVCacheSpec
    layer_ids: tuple[int, ...]  # the model's layer indices in this group; layer_ids[i] uses slot i
    pool_id: int = 0            # the pool (page shape) its block ids and tensors come from


def group_layers(specs: list[KVCacheSpec]) -> list[KVCacheGroup]:
    """Group layers with identical specs, one pool per page shape; within a pool, big kinds are
    split into groups of the pool's smallest kind."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer_id, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer_id)
    pools: dict[tuple, list[KVCacheSpec]] = {}
    for spec in by_spec:
        pools.setdefault(spec.page_shape, []).append(spec)
    groups: list[KVCacheGroup] = []
    for pool_id, pool_specs in enumerate(pools.values()):
        group_size = min(len(by_spec[s]) for s in pool_specs)
        for spec in pool_specs:
            layers = by_spec[spec]
            for start in range(0, len(layers), group_size):
                groups.append(KVCacheGroup(len(groups), spec, tuple(layers[start:start + group_size]), pool_id))
    return groups


def num_pools(groups: list[KVCacheGroup]) -> int:
    return max(g.pool_id for g in groups) + 1


def num_slots(groups: list[KVCacheGroup], pool_id: int | None = None) -> int:
    """Slots of one pool (None: of every pool together)."""
    if pool_id is None:
        return sum(num_slots(groups, p) for p in range(num_pools(groups)))
    return max(len(g.layer_ids) for g in groups if g.pool_id == pool_id)


def sliding_window_of(spec: KVCacheSpec) -> int | None:
    return getattr(spec, "sliding_window", None) or None
