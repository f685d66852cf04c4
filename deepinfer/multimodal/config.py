"""The settings of image input, vLLM's names where vLLM has them: how many images a prompt may
carry, where the server may fetch them from, and the encoder's share of each step.

Why a part of its own (EngineConfig.multimodal): both halves read it. The front end (the server's
chat routes, the offline LLM.chat) loads, checks and preprocesses images with the first group of
fields; the engine core's scheduler spends the encoder budget and keeps the encoder cache with
the second. A text-only model never reads any of it.

Fetching is off by default, unlike vLLM (which fetches any http(s) URL unless
--allowed-media-domains narrows it): a server that fetches what a client names is a request
forgery tool, so here nothing is fetched until an operator names the domains (or `*`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# vLLM's modalities; only images are read here.
MODALITIES = ("image", "video", "audio")


@dataclass(frozen=True)
class MultiModalConfig:
    """The string under each field is its --help text (cli/flags.py)."""

    limit_mm_per_prompt: str | None = None
    """vLLM's JSON object, e.g. '{"image": 2}': the most images one prompt may carry (more: a 400
    naming the limit); unset: as many as the context holds. Video and audio are not read here."""
    allowed_media_domains: tuple[str, ...] = ()
    """Domains the server may fetch http(s) image URLs from (a subdomain counts as its domain);
    * is any. Empty (the default): no URL is fetched; data: URLs always work."""
    allowed_local_media_path: str = ""
    """A directory whose files file:// image URLs may name (vLLM's flag; a security risk on a
    shared server). Empty: file:// URLs are refused."""
    media_fetch_timeout_s: float = 5.0
    """Seconds a fetch of one image URL may take, connection and body together."""
    max_image_bytes: int = 20 << 20
    """The largest image file accepted (a data: URL's decoded bytes, a fetched body, a file)."""
    max_image_pixels: int = 64 << 20
    """The most pixels (width x height) a decoded image may have, checked from its header."""
    max_num_encoder_input_tokens: int | None = None
    """vLLM's encoder budget per step, in image tokens: images whose encoder output is not cached
    beyond it wait for a later step (decodes go on). Unset: max_num_batched_tokens."""
    encoder_cache_size: int | None = None
    """vLLM's encoder cache, in image tokens (one token's embedding is hidden_size values): the
    encoder outputs kept for reuse across requests and turns, least recently used out first.
    Unset: the larger of the encoder budget and 8192. 0: off, every image is encoded in each step
    that reads it (an output is kept only for the step that made it)."""

    def __post_init__(self) -> None:
        if self.limit_mm_per_prompt is not None and not isinstance(self.limit_mm_per_prompt, str):
            # LLM(limit_mm_per_prompt={"image": 2}) as vLLM takes it: kept as the flag's JSON text.
            object.__setattr__(self, "limit_mm_per_prompt", json.dumps(self.limit_mm_per_prompt))
        object.__setattr__(self, "_limits", self.limits())   # a bad value fails at start; a warning shows once
        object.__setattr__(self, "allowed_media_domains", tuple(self.allowed_media_domains))
        for name in ("media_fetch_timeout_s", "max_image_bytes", "max_image_pixels"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name, least in (("max_num_encoder_input_tokens", 1), ("encoder_cache_size", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        path = self.allowed_local_media_path
        if path and not os.path.isdir(path):
            raise ValueError(f"allowed_local_media_path {path!r} is not a directory")

    def limits(self) -> dict[str, int]:
        """limit_mm_per_prompt as {modality: count} ({} when unset); ValueError names the field."""
        if self.limit_mm_per_prompt is None:
            return {}
        try:
            value: Any = json.loads(self.limit_mm_per_prompt)
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"limit_mm_per_prompt must be a JSON object such as {{\"image\": 2}}, got {value!r}")
        out = {}
        for modality, limit in value.items():
            count = limit.get("count", 0) if isinstance(limit, dict) else limit   # vLLM's {"count": N} form
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"limit_mm_per_prompt.{modality} must be an integer >= 0, got {limit!r}")
            if modality not in MODALITIES:
                raise ValueError(f"limit_mm_per_prompt.{modality}: unknown modality; known: {', '.join(MODALITIES)}")
            out[modality] = count
        if any(out.get(m) for m in ("video", "audio")):
            logger.warning("limit_mm_per_prompt allows video or audio: the models here read images only, so such "
                           "parts are refused whatever the limit")
        return out

    @property
    def image_limit(self) -> int | None:
        """The most images a prompt may carry; None: no limit of its own."""
        return self._limits.get("image")

    def encoder_budget(self, max_num_batched_tokens: int) -> int:
        return self.max_num_encoder_input_tokens or max_num_batched_tokens

    def cache_tokens(self, max_num_batched_tokens: int) -> int:
        """The encoder cache's size in image tokens; 0: the cache is off."""
        if self.encoder_cache_size is not None:
            return self.encoder_cache_size
        return max(self.encoder_budget(max_num_batched_tokens), 8192)
