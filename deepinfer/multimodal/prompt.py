"""Where an image's tokens sit in a prompt: put there (expansion) and found again (placeholders).

A Gemma 3 prompt names an image with one begin-of-image token (`<start_of_image>`, config
`boi_token_index`). transformers' Gemma3Processor replaces each one, in the prompt's text before
tokenizing, by

    "\\n\\n" <start_of_image> <image_soft_token> * mm_tokens_per_image <end_of_image> "\\n\\n"

and the model puts the image's embeddings, one each, at the <image_soft_token> positions
(`image_token_index`). Two ways to make that prompt here:

- `ImageTokenLayout.image_text(...)`: the replacement string, for a prompt still in text (what the
  processor does; the tokenizer then merges the "\\n\\n" with neighbouring newlines exactly as it
  does for transformers, so the ids agree with transformers' token for token);
- `ImageTokenLayout.expand(ids, newline_ids)`: the same on token ids, for a prompt already
  tokenized. The newlines are spliced in as `newline_ids` (the tokenizer's ids of "\\n\\n"), so
  where the text has newlines right beside the image marker the ids can differ from the text
  route's merged ones; the image tokens themselves are the same.

`placeholders(ids)` finds the images of an expanded prompt again: each a run of exactly
mm_tokens_per_image image tokens (offset, length), in prompt order, the order of the images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# transformers' Gemma3Config defaults, for a config.json that leaves a field out.
GEMMA3_BOI_TOKEN = 255_999
GEMMA3_EOI_TOKEN = 256_000
GEMMA3_IMAGE_TOKEN = 262_144
GEMMA3_TOKENS_PER_IMAGE = 256


@dataclass(frozen=True)
class ImagePlaceholder:
    """One image's tokens in a request's prompt: positions [offset, offset + length)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ImageTokenLayout:
    boi_token_id: int
    eoi_token_id: int
    image_token_id: int
    tokens_per_image: int

    @classmethod
    def from_config(cls, hf_config: dict[str, Any]) -> ImageTokenLayout:
        """From a Gemma 3 config.json (top-level fields, which the loader keeps beside the text
        model's)."""
        def field(name: str, default: int) -> int:
            value = hf_config.get(name)
            return default if value is None else int(value)

        return cls(field("boi_token_index", GEMMA3_BOI_TOKEN), field("eoi_token_index", GEMMA3_EOI_TOKEN),
                   field("image_token_index", GEMMA3_IMAGE_TOKEN),
                   field("mm_tokens_per_image", GEMMA3_TOKENS_PER_IMAGE))

    def image_text(self, boi_token: str, image_token: str, eoi_token: str) -> str:
        """What replaces each begin-of-image marker in a prompt's text (Gemma3Processor's
        full_image_sequence); the token strings are the tokenizer's (its boi_token, image_token,
        eoi_token)."""
        return f"\n\n{boi_token}{image_token * self.tokens_per_image}{eoi_token}\n\n"

    def image_ids(self, newline_ids: Sequence[int] = ()) -> list[int]:
        """One image's ids: newlines, begin, the image tokens, end, newlines."""
        return [*newline_ids, self.boi_token_id, *[self.image_token_id] * self.tokens_per_image,
                self.eoi_token_id, *newline_ids]

    def expand(self, token_ids: Sequence[int], newline_ids: Sequence[int] = ()) -> list[int]:
        """`token_ids` with each begin-of-image marker replaced by an image's ids (image_ids).
        The prompt must not hold image tokens already (an expanded prompt, expanded again, would
        have more image tokens than images)."""
        if self.image_token_id in token_ids:
            raise ValueError(f"the prompt already holds image tokens (id {self.image_token_id}); expand a prompt "
                             "that marks each image with one begin-of-image token only")
        out: list[int] = []
        image = self.image_ids(newline_ids)
        for token in token_ids:
            if token == self.boi_token_id:
                out.extend(image)
            else:
                out.append(token)
        return out

    def num_images(self, token_ids: Sequence[int]) -> int:
        """Images a prompt not yet expanded marks (its begin-of-image tokens)."""
        return sum(1 for t in token_ids if t == self.boi_token_id)

    def placeholders(self, token_ids: Sequence[int]) -> list[ImagePlaceholder]:
        """The image runs of an expanded prompt, in order. Each run must be exactly
        tokens_per_image long: a run of another length is a prompt the images cannot fill (two
        images back to back with nothing between them would be one run of twice the length,
        which Gemma 3's begin/end tokens never make)."""
        found: list[ImagePlaceholder] = []
        start = None
        for i, token in enumerate([*token_ids, None]):
            if token == self.image_token_id:
                if start is None:
                    start = i
            elif start is not None:
                if i - start != self.tokens_per_image:
                    raise ValueError(f"image tokens at positions {start}..{i - 1}: a run of {i - start}, but each "
                                     f"image has {self.tokens_per_image}")
                found.append(ImagePlaceholder(start, i - start))
                start = None
        return found
