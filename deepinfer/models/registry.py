"""Model classes by HF architecture name (the `architectures` field of config.json)."""

from __future__ import annotations

import importlib
from typing import Any

from deepinfer.models.base import CausalLM

# architecture name -> (module, class)
_MODELS = {
    "LlamaForCausalLM": ("deepinfer.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("deepinfer.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("deepinfer.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("deepinfer.models.llama", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("deepinfer.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("deepinfer.models.gemma3_mm", "Gemma3ForConditionalGeneration"),
    "DeepseekV4ForCausalLM": ("deepinfer.models.deepseek_v4.engine", "DeepseekV4ForCausalLM"),
}


# Architectures whose deepinfer model reads images through the engine (an encoder stage,
# `encode_images`, and forward's `images`; docs/vision.md). The chat routes ask this before
# accepting an image part, so any other model refuses images instead of dropping them.
_TAKES_IMAGES: frozenset[str] = frozenset({"Gemma3ForConditionalGeneration"})


def takes_images(hf_config: dict[str, Any]) -> bool:
    """Whether the model of this config.json reads image inputs."""
    return any(arch in _TAKES_IMAGES for arch in hf_config.get("architectures") or [])


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(hf_config: dict[str, Any]) -> type[CausalLM]:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"model architecture {archs or '(none given)'} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")
