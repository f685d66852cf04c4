"""What a draft model takes of the target's memory budget, for the runner that sizes the KV pool.

The draft model (spec_decode/draft_model.py) loads after the target's KV pool is sized, with as
many KV blocks as the target: the target's runner keeps room for both when it sizes its pool
(worker/kv_pool_size.py, kv_pool_blocks).
"""

from __future__ import annotations

import torch


def draft_footprint(draft_path: str, dtype: torch.dtype, block_size: int) -> tuple[int, int]:
    """(weight bytes, KV bytes per block) the draft model will take beside the target: the
    target's KV budget keeps room for both, since the draft gets as many blocks as the target
    (spec_decode/draft_model.py, DraftModelDrafter). Counted on a model built on the meta device (no
    memory), in the target's dtype with a KV cache of that dtype, as the drafter builds it. A draft
    with sliding-window layers is counted as if its windowed pools grew with the blocks too (its
    real pools are bounded): the room kept is then a little more than it needs."""
    from deepinfer.kv_cache.tensors import KVLayout
    from deepinfer.models.loader import load_model_source
    from deepinfer.models.registry import model_class

    hf_config = load_model_source(draft_path, skip_tokenizer_init=True).hf_config
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(hf_config)(hf_config)
    finally:
        torch.set_default_dtype(previous)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights, KVLayout.from_specs(model.kv_cache_specs(dtype), block_size, dtype).bytes_per_block
