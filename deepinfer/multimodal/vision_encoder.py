"""The encoder stage alone: Gemma 3's SigLIP tower and projector, without the language model.

What an encode instance (`deepinfer serve --kv-role encode`, multimodal/encode_server.py) runs:
it never computes a token, so it builds neither the language model's layers nor a KV pool, and
reads only the vision tensors of the checkpoint. `encode_images` does the operations of
Gemma3ForConditionalGeneration.encode_images (models/gemma3_mm.py) in the same order and dtypes,
so its outputs are the ones a serving instance of the same checkpoint and dtype computes itself:
the store's entries stand in for them exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepinfer.models.gemma3_mm import GEMMA3_TEXT_DEFAULTS, VISION_PREFIXES, canonical_weight_name
from deepinfer.models.hf_loader import flatten_multimodal_config
from deepinfer.multimodal.gemma3_projector import Gemma3MultiModalProjector
from deepinfer.multimodal.prompt import ImageTokenLayout
from deepinfer.multimodal.siglip import SiglipVisionTower


class VisionEncoder(nn.Module):
    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        cfg = flatten_multimodal_config(hf_config)
        if not cfg.get("vision_config"):
            raise ValueError("an encode instance needs a model with a vision_config (Gemma3ForConditionalGeneration)")
        hidden = cfg.get("hidden_size") or GEMMA3_TEXT_DEFAULTS["hidden_size"]
        self.output_dtype = dtype
        self.image_layout = ImageTokenLayout.from_config(cfg)
        self.vision_tower = SiglipVisionTower(cfg["vision_config"])
        self.multi_modal_projector = Gemma3MultiModalProjector(self.vision_tower.config, hidden,
                                                               self.image_layout.tokens_per_image)

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """The checkpoint's vision tensors (every layout gemma3_mm reads); the rest is skipped."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            target = canonical_weight_name(name)
            if target is None or not target.startswith(VISION_PREFIXES):
                continue
            if target not in params or params[target].shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} has no place in the vision encoder")
            params[target].copy_(tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks vision tensors: {missing[:8]}")

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, 3, S, S] -> [n, mm_tokens_per_image, hidden] in the output dtype."""
        weight = self.vision_tower.embeddings.patch_embedding.weight
        patches = self.vision_tower(pixel_values.to(device=weight.device, dtype=weight.dtype))
        return self.multi_modal_projector(patches).to(dtype=self.output_dtype)


def build_vision_encoder(source: Any, dtype: torch.dtype, device: torch.device) -> VisionEncoder:
    """The vision encoder of a ModelSource, built in `dtype` on `device` and loaded."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            encoder = VisionEncoder(source.hf_config, dtype).eval()
    finally:
        torch.set_default_dtype(previous)
    encoder.load_weights(source.iter_weights())
    return encoder
