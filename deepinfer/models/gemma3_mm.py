"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): the Gemma 3 language model, the SigLIP
vision tower and the multimodal projector, loaded from one checkpoint.

The language model is models/gemma3.py's, unchanged: a text-only step (no images) runs exactly
Gemma3ForCausalLM's forward. Images enter through two seams the engine calls:

    encode_images(pixel_values [n, 3, S, S]) -> [n, mm_tokens_per_image, hidden]
        the encoder stage (tower + projector), in the language model's dtype; its outputs are
        what an encoder cache keeps, keyed by the image's hash (multimodal/image_processor.py)
    forward(input_ids, positions, logits_rows, images=StepImages)
        the step's image rows take these embeddings instead of their token embeddings, and the
        image's tokens attend to each other both ways (multimodal/step_images.py)

Checkpoint layouts (each tensor's name is mapped to this model's by `canonical_weight_name`):

    hub (Google's)                 language_model.model.*, vision_tower.vision_model.*, multi_modal_projector.*
    late transformers 4.x save     model.language_model.*, model.vision_tower.vision_model.*,
                                   model.multi_modal_projector.*, lm_head.weight
    transformers 5.x save          language_model.model.*, vision_tower.* (no vision_model level),
                                   multi_modal_projector.* (the head tied, not saved)

The text model's tensors then go through CausalLM.load_weights (q/k/v and gate/up fused, tensor
parallel slices); the tower's and the projector's are copied by name, whole on every rank. The
tower's attention-pooling head (`vision_tower.head.*`, in checkpoints whose vision config keeps
SigLIP's vision_use_head) feeds nothing Gemma 3 reads and is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from deepinfer.layers.attention.metadata import forward_context, get_forward_context
from deepinfer.models.gemma3 import Gemma3ForCausalLM
from deepinfer.models.hf_loader import flatten_multimodal_config
from deepinfer.multimodal.gemma3_projector import Gemma3MultiModalProjector
from deepinfer.multimodal.prompt import ImageTokenLayout
from deepinfer.multimodal.siglip import SiglipVisionTower
from deepinfer.multimodal.step_images import StepImages, image_attention_metadata

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")

# transformers' Gemma3TextConfig defaults: Google's Gemma 3 config.json files write only the text
# fields that differ from them (a 4B's text_config names its sizes and rope scaling, not its
# vocabulary, heads or rope bases), so a field left out means this value.
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True,
    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, model_type="gemma3_text")


def canonical_weight_name(name: str) -> str | None:
    """A checkpoint tensor's name in this model (the layouts of the module docstring), or None for
    a tensor it does not use."""
    if name.startswith(("model.language_model.", "model.vision_tower.", "model.multi_modal_projector.")):
        name = name[len("model."):]
    if name.startswith("language_model.lm_head."):
        return "lm_head." + name[len("language_model.lm_head."):]
    if name.startswith("language_model.model."):
        return "model." + name[len("language_model.model."):]
    if name.startswith("language_model."):
        return "model." + name[len("language_model."):]
    if name.startswith("vision_tower.vision_model."):
        name = "vision_tower." + name[len("vision_tower.vision_model."):]
    if name.startswith("vision_tower.head."):
        return None
    return name


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        cfg = flatten_multimodal_config(hf_config)
        if not cfg.get("vision_config"):
            raise ValueError("Gemma3ForConditionalGeneration needs the checkpoint's vision_config")
        if cfg.get("model_type") == "gemma3":   # an empty text_config: the outer model_type came up
            cfg.pop("model_type")
        cfg = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k not in GEMMA3_TEXT_DEFAULTS}}
        super().__init__(cfg)
        self.image_layout = ImageTokenLayout.from_config(cfg)
        self.vision_tower = SiglipVisionTower(cfg["vision_config"])
        self.multi_modal_projector = Gemma3MultiModalProjector(
            self.vision_tower.config, cfg["hidden_size"], self.image_layout.tokens_per_image)

    # -- images ----------------------------------------------------------------------------------

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, 3, S, S] -> image embeddings [n, mm_tokens_per_image, hidden] in the
        language model's dtype and device, one row per image token of each image."""
        weight = self.vision_tower.embeddings.patch_embedding.weight
        patches = self.vision_tower(pixel_values.to(device=weight.device, dtype=weight.dtype))
        embed = self.model.embed_tokens.weight
        return self.multi_modal_projector(patches).to(device=embed.device, dtype=embed.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_rows: torch.Tensor | None = None, images: StepImages | None = None) -> torch.Tensor:
        """CausalLM.forward; `images`: the step's image rows and their embeddings. Without them
        this is the text model's forward, op for op."""
        if images is None or not images.spans:
            return self.model(input_ids, positions, logits_rows)
        rows = images.rows(input_ids.device)
        # Attention within each image both ways, as transformers does for a prompt with
        # token_type_ids (multimodal/step_images.py): the step's masks with that term added.
        with forward_context(image_attention_metadata(get_forward_context(), images.spans)):
            return self.model(input_ids, positions, logits_rows,
                              image_embeds=(rows, images.embeds.to(input_ids.device)))

    # -- weights ---------------------------------------------------------------------------------

    @torch.no_grad()
    def random_weights(self, seed: int) -> None:
        """load_format="dummy": the projection starts at zeros (transformers' init, which a
        checkpoint always overwrites), so every image would embed to nothing and look alike to
        the language model; draw it from the seed at the scale that keeps the soft-normed
        patches' projection near unit size. The tower keeps its layers' init."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        generator = torch.Generator(device="cpu").manual_seed(seed)
        drawn = torch.randn(weight.shape, generator=generator, dtype=torch.float32) / weight.shape[0] ** 0.5
        weight.copy_(drawn.to(device=weight.device, dtype=weight.dtype))


    def streamed_parameters(self) -> dict[str, nn.Parameter]:
        """The language model's parameters (load_weights fills the tower and projector apart)."""
        return {n: p for n, p in self.named_parameters() if not n.startswith(VISION_PREFIXES)}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision = {n: p for n, p in self.named_parameters() if n.startswith(VISION_PREFIXES)}
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                target = canonical_weight_name(name)
                if target is None:
                    continue
                if not target.startswith(VISION_PREFIXES):
                    yield target, tensor
                    continue
                if target not in vision:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                if vision[target].shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(vision[target].shape)}")
                vision[target].copy_(tensor)
                loaded.add(target)

        super().load_weights(text_weights())
        missing = sorted(set(vision) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {missing[:8]}" + (" ..." if len(missing) > 8 else ""))
