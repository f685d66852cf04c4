"""The attention layer models use: writes this step's K/V into the paged cache, then attends."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.attention.metadata import get_forward_context


class Attention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, sliding_window: int | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, heads*head_dim]."""
        meta = get_forward_context()
        group = meta.groups[meta.layer_to_group[self.layer_id]]
        k_cache, v_cache = meta.kv_caches[meta.layer_to_slot[self.layer_id]]
        k_cache.index_copy_(0, group.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, group.slot_mapping, v.to(v_cache.dtype))

        out = torch.empty_like(q)
        n_dec = meta.num_decode_tokens
        if n_dec:
            # [B, 1, H, D] queries against [B, L, Hkv, D] gathered keys; one batched call.
            keys = k_cache[group.decode_gather]
            values = v_cache[group.decode_gather]
            out[:n_dec] = self._sdpa(q[:n_dec].unsqueeze(1), keys, values, group.decode_mask).squeeze(1)
        for (start, end), (rows, mask) in zip(meta.prefill_query_ranges, group.prefill):
            keys = k_cache[rows].unsqueeze(0)
            values = v_cache[rows].unsqueeze(0)
            out[start:end] = self._sdpa(q[start:end].unsqueeze(0), keys, values, mask.unsqueeze(0)).squeeze(0)
        return out.reshape(q.shape[0], -1)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q: [B, Q, H, D], k/v: [B, L, Hkv, D], mask: [B, Q, L] (True = may attend; None = all)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.unsqueeze(1),
                                             scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)
        return out.transpose(1, 2)
