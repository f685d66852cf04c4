"""A multi-token-prediction (MTP) layer, as in DeepSeek's released inference code.

transformers does not build these (it drops the checkpoint's mtp.* keys). The layer is a
full decoder layer (its own attention kind from the checkpoint's compress_ratios entry after
the main layers, 0 = sliding only in the release; a learned-routed MoE) with a front and its
own head collapse:
  e = enorm(embed(next_token));  h = hnorm(main streams)        (per stream)
  X = e_proj(e)[:, :, None] + h_proj(h)                          [B, L, hc_mult, hidden]
  X = decoder_layer(X);  logits = lm_head(norm(hc_head(X)))
The embedding and lm_head are the main model's. At position p it reads the main model's last
streams at p and the token at p + 1, and predicts the token at p + 2; its attention keeps its
own per-request state, at the main sequence's positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.layers.linear import Linear
from deepinfer.models.deepseek_v4.config import V4Config
from deepinfer.models.deepseek_v4.decoder import V4DecoderLayer
from deepinfer.models.deepseek_v4.hyper import HyperHead
from deepinfer.models.deepseek_v4.norm import V4RMSNorm
from deepinfer.models.deepseek_v4.rope import V4Rotary
from deepinfer.models.deepseek_v4.state import LayerState


class V4MTPLayer(V4DecoderLayer):
    def __init__(self, cfg: V4Config, layer_type: str, rotaries: dict[str, V4Rotary]) -> None:
        super().__init__(cfg, layer_type, "moe", rotaries)
        hidden = cfg.hidden_size
        self.e_proj = Linear(hidden, hidden, bias=False)
        self.h_proj = Linear(hidden, hidden, bias=False)
        self.enorm = V4RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = V4RMSNorm(hidden, cfg.rms_norm_eps)
        self.norm = V4RMSNorm(hidden, cfg.rms_norm_eps)
        self.hc_head = HyperHead(hidden, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)

    def forward(self, streams: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                state: LayerState, embed: nn.Module,
                lm_head: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.enorm(embed(next_ids))
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        x = super().forward(x, positions, state, next_ids)
        return lm_head(self.norm(self.hc_head(x))), x
