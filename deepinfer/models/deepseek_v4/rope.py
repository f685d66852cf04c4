"""V4's rotary embedding: interleaved pairs, on the trailing `rope_dim` channels of a head.

deepinfer/layers/rotary.py rotates the two halves of a head (HF's Llama layout); V4 instead
rotates channel pairs (2i, 2i+1) and only inside the last `rope_dim` channels, leaving the
leading "nope" channels as they are. Each layer kind picks one of two settings ("main" for
sliding-only layers, "compress" for layers with a compressor); see config._rope_settings.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from deepinfer.layers.attention.metadata import current_backend


def v4_inverse_frequencies(rope_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """One frequency per channel pair, [rope_dim // 2], for "default" or "yarn" rope."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    spins = base ** exponents
    plain = 1.0 / spins
    kind = params.get("rope_type", "default")
    if kind == "default":
        return plain
    if kind != "yarn":
        raise ValueError(f"DeepSeek-V4 rope_type {kind!r} is not supported (default, yarn)")
    # YaRN: pairs that turn many times over the original context keep their frequency, pairs
    # that turn less than once are slowed by `factor`, a linear blend in between.
    factor = float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def pair_index_for(turns: float) -> float:   # the pair that turns `turns` times in old_len
        return rope_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(pair_index_for(fast)), 0)
    hi = min(math.ceil(pair_index_for(slow)), rope_dim - 1)
    if lo == hi:
        hi += 0.001
    blend = ((torch.arange(rope_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - blend                      # 1: keep the original frequency, 0: divide by factor
    return 1.0 / (factor * spins) * (1 - keep) + plain * keep


class V4Rotary(nn.Module):
    """cos / sin tables for one rope setting; `rotate(x, positions)` turns the trailing
    `rope_dim` channels of x [..., tokens, heads, dim] (positions [..., tokens]) by their
    position, `rotate(x, positions, inverse=True)` turns them back."""

    def __init__(self, rope_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        scale = float(params.get("attention_factor", 1.0)) if params.get("rope_type") == "yarn" else 1.0
        self.scale = scale
        self.register_buffer("inv_freq", v4_inverse_frequencies(rope_dim, params), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., rope_dim / 2] of positions [...], times the attention factor."""
        angles = positions[..., None].float() * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        return (cos, sin) if self.scale == 1.0 else (cos * self.scale, sin * self.scale)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False,
               tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [B, T, H, D] (H may be 1); positions [T], one per token, shared by the batch. Where
        the forward's backend turns on fused_rotary (V4's Triton path), one Triton kernel
        (triton_rope.py) with this as its reference; `tables`, the positions' cos_sin when the
        caller has them (a step's layers share them), serve the kernel."""
        if current_backend().fused_rotary:
            from deepinfer.models.deepseek_v4.triton_rope import rotate
            return rotate(x, tables if tables is not None else self.cos_sin(positions), inverse)
        cos, sin = self.cos_sin(positions)
        if inverse:
            sin = -sin
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        nope, rot = x[..., :-self.rope_dim], x[..., -self.rope_dim:].float()
        even, odd = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat((nope, turned.to(x.dtype)), dim=-1)
