"""One V4 decoder layer: mHC around attention, then mHC around the MoE.

  block_in, post, comb = attn_hc(X);  X = merge(X, self_attn(input_layernorm(block_in)), post, comb)
  block_in, post, comb = ffn_hc(X);   X = merge(X, mlp(post_attention_layernorm(block_in)), post, comb)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.models.deepseek_v4.attention import V4Attention
from deepinfer.models.deepseek_v4.config import V4Config
from deepinfer.models.deepseek_v4.hyper import HyperConnection
from deepinfer.models.deepseek_v4.moe import V4MoE
from deepinfer.models.deepseek_v4.norm import V4RMSNorm
from deepinfer.models.deepseek_v4.rope import V4Rotary
from deepinfer.models.deepseek_v4.state import LayerState


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, layer_type: str, mlp_type: str, rotaries: dict[str, V4Rotary]) -> None:
        super().__init__()
        self.self_attn = V4Attention(cfg, layer_type, rotaries)
        self.mlp = V4MoE(cfg, mlp_type)
        self.input_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, state: LayerState,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """streams [B, L, hc_mult, hidden] -> the same shape."""
        return self.run(streams, lambda x: self.self_attn(x, positions, state), token_ids)

    def run(self, streams: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor],
            token_ids: torch.Tensor | None) -> torch.Tensor:
        """The layer with attention given as `attend(normed block input) -> output`: the
        reference's own state above, the engine's paged cache (paged.py)."""
        block_in, post, comb = self.attn_hc(streams)
        out = attend(self.input_layernorm(block_in))
        streams = HyperConnection.merge(streams, out, post, comb)
        block_in, post, comb = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(block_in), token_ids)
        return HyperConnection.merge(streams, out, post, comb)
