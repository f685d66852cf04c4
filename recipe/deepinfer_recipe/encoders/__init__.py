"""Encoders: Conversation → RenderedPrompt (+ token ids). Pick one by format name."""

from __future__ import annotations

import functools

from ..errors import RecipeError
from ..tokenize import SafeTokenizer
from .base import Encoder, OutputMarkers, ParserStart, PromptEncoding
from .deepseek_v4 import DeepSeekV4Encoder, DeepSeekV41Encoder

FORMATS = ("deepseek-v4", "deepseek-v4.1", "hf:PATH")


@functools.lru_cache(maxsize=16)
def get_encoder(format: str, tokenizer_path: str | None = None) -> Encoder:
    """`deepseek-v4`, `deepseek-v4.1` or `hf:PATH` (a directory with tokenizer.json and
    tokenizer_config.json). `tokenizer_path` overrides the tokenizer.json (V4.1 has none)."""
    tokenizer = SafeTokenizer.from_file(tokenizer_path) if tokenizer_path else None
    if format == "deepseek-v4":
        return DeepSeekV4Encoder(tokenizer)
    if format == "deepseek-v4.1":
        return DeepSeekV41Encoder(tokenizer)
    if format.startswith("hf:"):
        from .hf_template import HFTemplateEncoder

        return HFTemplateEncoder.from_directory(format[3:], tokenizer_path=tokenizer_path)
    raise RecipeError(f"unknown format {format!r}; expected one of {FORMATS}")


__all__ = ["Encoder", "OutputMarkers", "ParserStart", "PromptEncoding", "get_encoder", "FORMATS",
           "DeepSeekV4Encoder", "DeepSeekV41Encoder"]
