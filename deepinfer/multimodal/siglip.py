"""The SigLIP vision tower (the encoder of Gemma 3's images), in plain torch.

pixel_values [n, 3, S, S] -> hidden states [n, (S/P)^2, C], one per P x P patch, row-major:

    patch embedding     a P x P convolution with stride P (C channels out), plus a learned
                        position embedding per patch
    encoder layers      pre-norm transformer blocks: LayerNorm -> multi-head self-attention over
                        all patches of the image (no mask: an image attends to itself whole) ->
                        residual; LayerNorm -> fc1 -> gelu -> fc2 -> residual
    post_layernorm      a last LayerNorm

Why here and not transformers: transformers is a test-time reference only. The module names are
transformers' (SiglipVisionModel's: `embeddings.patch_embedding`, `encoder.layers.N.self_attn.q_proj`,
`post_layernorm`, ...), so a checkpoint's tensors land by name once their prefix is taken off
(models/gemma3_mm.py maps the prefixes of each checkpoint layout). SigLIP's attention-pooling head
(`head.*`, vision_use_head) is not built: Gemma 3 reads the patch states, never the pooled one.

The tower is replicated on every tensor-parallel rank (plain nn.Linear, not the TP layers): it is
small beside the language model, and its output is needed whole on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _activation(name: str):
    """The MLP activation a vision config names (transformers' ACT2FN names)."""
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):   # the tanh approximation, one formula
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"vision tower activation {name!r} is not supported")


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, self.patch_size, self.image_size = cfg["hidden_size"], cfg["patch_size"], cfg["image_size"]
        self.patch_embedding = nn.Conv2d(cfg.get("num_channels", 3), hidden, kernel_size=self.patch_size,
                                         stride=self.patch_size)
        self.num_patches = (self.image_size // self.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        height, width = pixel_values.shape[-2:]
        # One position embedding per patch of the trained size: another size would need them
        # interpolated, which Gemma 3 never does (its processor resizes every image to this size).
        if (height, width) != (self.image_size, self.image_size):
            raise ValueError(f"the vision tower reads {self.image_size}x{self.image_size} images, got "
                             f"{height}x{width} pixel_values")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))   # [n, C, g, g]
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        if hidden % self.num_heads:
            raise ValueError(f"vision hidden_size {hidden} is not a multiple of its {self.num_heads} heads")
        self.head_dim = hidden // self.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, hidden = x.shape
        q, k, v = (proj(x).view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)   # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, length, hidden))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])
        self.fc2 = nn.Linear(cfg["intermediate_size"], cfg["hidden_size"])
        self.act = _activation(cfg.get("hidden_act", "gelu_pytorch_tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        eps = cfg.get("layer_norm_eps", 1e-6)
        self.layer_norm1 = nn.LayerNorm(cfg["hidden_size"], eps=eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg["hidden_size"], eps=eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# Vision config fields transformers' SiglipVisionConfig defaults (a config.json may leave them out).
SIGLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                       layer_norm_eps=1e-6)


class SiglipVisionTower(nn.Module):
    """pixel_values [n, 3, S, S] -> last hidden states [n, patches, hidden] (post-LayerNorm)."""

    def __init__(self, vision_config: dict[str, Any]) -> None:
        super().__init__()
        cfg = {**SIGLIP_DEFAULTS, **{k: v for k, v in vision_config.items() if v is not None}}
        self.config = cfg
        self.embeddings = SiglipVisionEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])

    @property
    def num_patches(self) -> int:
        return self.embeddings.num_patches

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.embeddings.patch_embedding.in_channels:
            raise ValueError(f"pixel_values must be [n, {self.embeddings.patch_embedding.in_channels}, H, W], "
                             f"got {tuple(pixel_values.shape)}")
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))
