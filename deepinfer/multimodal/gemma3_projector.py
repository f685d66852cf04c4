"""Gemma 3's multimodal projector: the tower's patch states -> the image's embeddings in the
language model's space, mm_tokens_per_image of them.

    [n, g*g, Cv]  patch states on a g x g grid (g = image_size / patch_size)
    -> average pool, kernel = stride = g / sqrt(mm_tokens_per_image)   [n, t*t, Cv], t*t = mm_tokens
    -> RMSNorm in Gemma's convention: x / rms(x) * (1 + w), in float32
    -> matmul by mm_input_projection_weight [Cv, Ct]                    [n, mm_tokens, Ct]

As transformers' Gemma3MultiModalProjector computes it (the same order, the norm in float32 and
rounded to the states' dtype after the scale). Gemma 3 checkpoints: a 64 x 64 grid pooled by 4
into 16 x 16 = 256 tokens. The embeddings are not scaled by sqrt(hidden_size) as the token
embeddings are: they replace the scaled token embeddings at the image positions as they are.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SoftEmbeddingNorm(nn.Module):
    """Gemma's RMSNorm, x / rms(x) * (1 + w), computed in float32 and rounded once to the input's
    dtype (the language model's GemmaRMSNorm picks a fused kernel by the step's backend; the
    encoder runs outside any step, so it has its own)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, vision_config: dict[str, Any], text_hidden_size: int, mm_tokens_per_image: int) -> None:
        super().__init__()
        vision_hidden = vision_config["hidden_size"]
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision_hidden, text_hidden_size))
        self.mm_soft_emb_norm = SoftEmbeddingNorm(vision_hidden, vision_config.get("layer_norm_eps", 1e-6))
        self.patches_per_side = vision_config["image_size"] // vision_config["patch_size"]
        self.tokens_per_side = math.isqrt(mm_tokens_per_image)
        self.kernel = self.patches_per_side // max(self.tokens_per_side, 1)
        # The pooled grid must hold exactly mm_tokens_per_image tokens: the prompt has that many
        # image tokens for each image, and the embeddings fill them one for one.
        if (self.tokens_per_side ** 2 != mm_tokens_per_image or self.kernel == 0
                or self.patches_per_side // self.kernel != self.tokens_per_side):
            raise ValueError(f"mm_tokens_per_image={mm_tokens_per_image} is not a square grid that a "
                             f"{self.patches_per_side}x{self.patches_per_side} patch grid pools into")
        self.mm_tokens_per_image = mm_tokens_per_image

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[n, patches, vision hidden] -> [n, mm_tokens_per_image, text hidden], in the states' dtype."""
        n, num_patches, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(n, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(patches.dtype)
