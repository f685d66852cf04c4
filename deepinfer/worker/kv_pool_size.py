"""How many KV blocks a runner's pools get (ModelRunner._size_kv_pool asks once, at start-up).

The main pools (full-attention kinds) take what the memory budget leaves; pools of bounded kinds
(sliding windows, compressed rings) take a fixed count from the scheduler's limits, since a
request never holds more of them than its window. num_kv_blocks, where set, replaces the budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.worker.input_batch import max_sliding_window

if TYPE_CHECKING:
    import torch

    from deepinfer.config import EngineConfig
    from deepinfer.kv_cache.tensors import KVLayout
    from deepinfer.layers.attention.backends.base import AttentionBackend
    from deepinfer.platforms import Platform
    from deepinfer.spec_decode.method import SpeculativeMethod


def bounded_pool_blocks(config: EngineConfig, layout: KVLayout) -> int:
    """Block ids a pool of windowed kinds gets: for each of max_num_seqs requests its window
    (+ 2: the next token, and one more block boundary it may straddle) in each of the pool's
    groups, plus one step's chunk; twice that, so that blocks of finished requests stay
    cached for a while (swa_retention_s) without taking running requests' room."""
    scheduler, bs, groups = config.scheduler, config.cache.block_size, layout.groups
    window = max_sliding_window(groups)
    groups_per_pool = max(sum(1 for g in groups if g.pool_id == p) for p in range(layout.num_pools))
    per_request = groups_per_pool * (-(-window // bs) + 2)
    return 2 * (scheduler.max_num_seqs * per_request + -(-scheduler.max_num_batched_tokens // bs)) + 1


def kv_pool_blocks(config: EngineConfig, layout: KVLayout, platform: Platform, backend: AttentionBackend,
                   hf_config: dict, weight_bytes: int, speculation: SpeculativeMethod | None, dtype: torch.dtype,
                   max_model_len: int) -> tuple[int, list[int]]:
    """(block ids of the main pools, block ids per pool): num_kv_blocks, or what the memory
    budget (after the weights, `weight_bytes`) holds once the pools of bounded kinds have what
    they need."""
    cache = config.cache
    bounded = layout.bounded_pools(max_model_len)
    bounded_blocks = bounded_pool_blocks(config, layout)
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    else:
        budget = platform.kv_cache_budget_bytes(
            gpu_memory_utilization=cache.gpu_memory_utilization,
            cpu_kv_cache_bytes=cache.cpu_kv_cache_bytes, weight_bytes=weight_bytes)
        fixed = sum(bounded_blocks * layout.pool_bytes_per_block(p) for p, b in enumerate(bounded) if b)
        fixed += backend.workspace_bytes(layout.groups, max_model_len, config.scheduler.max_num_batched_tokens,
                                         hf_config.get("num_attention_heads", 0))
        per_block = sum(layout.pool_bytes_per_block(p) for p, b in enumerate(bounded) if not b)
        if speculation is not None and speculation.has_draft_model:
            # The draft model loads after this pool is sized and takes as many blocks: room for
            # its KV a block, and on a GPU (whose budget is all the process may use) for its
            # weights.
            from deepinfer.worker.spec.draft_model_memory import draft_footprint

            draft_weights, draft_per_block = draft_footprint(speculation.config.model, dtype, cache.block_size)
            per_block += draft_per_block
            if platform.kv_budget_includes_weights:
                fixed += draft_weights
        num_blocks = max((budget - fixed) // per_block, 2)
    return num_blocks, layout.pool_blocks(num_blocks, bounded_blocks, max_model_len)
