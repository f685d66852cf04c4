"""The front end's side of images: a request's image parts -> checked, decoded, resized pixels
and hashes, and the prompt positions they fill -> the ImageInputs the engine request carries.

Used by every entry point that takes images: the server's chat routes (OpenAI image_url parts,
Anthropic image blocks, Responses input_image parts; entrypoints/conversation.py) and the offline
LLM.chat / LLM.generate(multi_modal_data=...). Everything that can be wrong with an image is
found here, before the engine sees the request: too many images (--limit-mm-per-prompt), a URL
the server may not fetch, not an image, truncated, too large. Each is a RequestError naming the
image part (messages[0].content[1]), so the routes answer 400 in their own protocol.

    images = ImageFrontEnd.from_source(config.multimodal, source)   # None: a text-only model
    loaded = images.load(conversation)                    # before the render
    encoding = encoder.encode(conversation)               # image markers expanded (recipe images.py)
    inputs = images.inputs(encoding.token_ids, loaded)    # ImageInputs: hashes, offsets, pixels
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from deepinfer_recipe import Conversation, RequestError
from deepinfer_recipe.conversation import ImagePart
from deepinfer_recipe.images import ImagePrompt

from deepinfer.models.registry import takes_images
from deepinfer.multimodal.config import MultiModalConfig
from deepinfer.multimodal.image_processor import ImageProcessor
from deepinfer.multimodal.inputs import ImageInputs
from deepinfer.multimodal.media import MediaLoader
from deepinfer.multimodal.prompt import ImageTokenLayout


def image_prompt_for(source: Any) -> ImagePrompt | None:
    """How a chat encoder writes an image of this model (recipe images.py): the template's
    begin-of-image marker becomes Gemma3Processor's image text. None without a tokenizer."""
    tokenizer = getattr(source, "tokenizer", None)
    if tokenizer is None:
        return None
    layout = ImageTokenLayout.from_config(source.hf_config)
    boi, eoi, image = (tokenizer.backend.id_to_token(t) for t in (layout.boi_token_id, layout.eoi_token_id,
                                                                  layout.image_token_id))
    if None in (boi, eoi, image):
        return None
    pieces = ((False, "\n\n"), (True, boi), *[(True, image)] * layout.tokens_per_image, (True, eoi), (False, "\n\n"))
    return ImagePrompt(boi, pieces)


@dataclass(frozen=True)
class LoadedImage:
    pixels: np.ndarray    # resized RGB, uint8 [H, W, 3]
    image_hash: str


class ImageFrontEnd:
    def __init__(self, config: MultiModalConfig, layout: ImageTokenLayout, processor: ImageProcessor,
                 backend_tokenizer: Any = None) -> None:
        self.config = config
        self.layout = layout
        self.processor = processor
        self.media = MediaLoader(config)
        self.backend_tokenizer = backend_tokenizer   # tokenizers.Tokenizer, or None

    @classmethod
    def from_source(cls, config: MultiModalConfig, source: Any) -> ImageFrontEnd | None:
        """The front end's images for a model that reads them, else None."""
        if not takes_images(source.hf_config):
            return None
        processor = ImageProcessor.from_pretrained(source.path, source.hf_config, max_pixels=config.max_image_pixels)
        tokenizer = getattr(source, "tokenizer", None)
        return cls(config, ImageTokenLayout.from_config(source.hf_config), processor,
                   tokenizer.backend if tokenizer is not None else None)

    # -------------------------------------------------------------------------------- prompts
    def _spelling(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id) if self.backend_tokenizer is not None else None

    def expand_text(self, text: str) -> str:
        """A text prompt's begin-of-image markers replaced by the image text (LLM.generate)."""
        boi = self._spelling(self.layout.boi_token_id)
        image_text = self.layout.image_text(boi, self._spelling(self.layout.image_token_id),
                                            self._spelling(self.layout.eoi_token_id))
        return text.replace(boi, image_text)

    # --------------------------------------------------------------------------------- images
    def check_count(self, count: int, path: str | None = None) -> None:
        limit = self.config.image_limit
        if limit is not None and count > limit:
            raise RequestError(f"this prompt has {count} images, more than this server's limit of {limit} "
                               "(--limit-mm-per-prompt)", path)

    def load(self, conversation: Conversation) -> list[LoadedImage]:
        """Every image part of the conversation, in order, loaded and checked (RequestError)."""
        parts = [p for m in conversation.messages for p in m.content if isinstance(p, ImagePart)]
        limit = self.config.image_limit
        self.check_count(len(parts), parts[limit].path if limit is not None and len(parts) > limit else None)
        loaded = []
        for part in parts:
            try:
                loaded.append(self.load_bytes(self.media.load(part.url)))
            except ValueError as e:
                raise RequestError(str(e), part.path) from None
        return loaded

    def load_bytes(self, data: bytes) -> LoadedImage:
        return self.load_image(self.processor.decode(data))

    def load_image(self, image: Any) -> LoadedImage:
        """A decoded (PIL) image: its resized pixels and its hash."""
        rgb = self.processor.to_rgb(image)
        return LoadedImage(self.processor.resized(rgb), self.processor.image_hash(rgb))

    def for_prompt(self, text: str | None, token_ids: list[int] | None, data: Any,
                   tokenizer: Any) -> tuple[list[int], ImageInputs | None]:
        """LLM.generate's {"prompt" or "prompt_token_ids", "multi_modal_data": {"image": ...}}
        (vLLM's form): images as PIL images or encoded bytes; the prompt marks each with the
        begin-of-image token (in text, its spelling), which is expanded here."""
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes {{'image': image or [images]}} here, got keys "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        images = data.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        self.check_count(len(images), "multi_modal_data.image")
        loaded = [self.load_bytes(bytes(x)) if isinstance(x, (bytes, bytearray, memoryview)) else self.load_image(x)
                  for x in images]
        if token_ids is None:
            token_ids = tokenizer.encode(self.expand_text(text))
        elif self.layout.image_token_id not in token_ids:
            token_ids = self.layout.expand(token_ids, tokenizer.encode("\n\n", add_special_tokens=False))
        return token_ids, self.inputs(token_ids, loaded)

    def inputs(self, token_ids: Sequence[int], loaded: Sequence[LoadedImage]) -> ImageInputs | None:
        """The ImageInputs of an expanded prompt (None: no images); RequestError when the prompt's
        image runs and the images do not pair up."""
        try:
            places = self.layout.placeholders(token_ids)
        except ValueError as e:
            raise RequestError(str(e), "messages") from None
        if len(places) != len(loaded):
            raise RequestError(f"the prompt has places for {len(places)} image(s) but {len(loaded)} were given",
                               "messages")
        if not loaded:
            return None
        return ImageInputs([im.image_hash for im in loaded], [p.offset for p in places], self.layout.tokens_per_image,
                           [im.pixels.tobytes() for im in loaded], [tuple(im.pixels.shape[:2]) for im in loaded])
