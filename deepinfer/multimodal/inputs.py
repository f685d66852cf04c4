"""A request's images as they travel from the front end to the engine core and live there.

`ImageInputs` is what a request carries beside its token ids (engine/admission.AddRequest, then
types/request.Request): per image its hash, the position of its first image token, and its
resized RGB pixels. Why these and not pixel_values: the uint8 pixels are a quarter of float32
pixel_values' bytes over the process boundary (msgpack carries them as binary, not as lists),
and the rescale and normalize that make pixel_values from them are exact, so the runner does
them where the encoder runs (multimodal/image_processor.py, `normalize`).

The hash (image_processor.image_hash: the pixels and every processor setting) is the image's
identity everywhere after the front end: the encoder cache's key (multimodal/encoder_cache.py),
and part of the prefix-cache key of every KV block its tokens touch (`extend_block_hashes`), so
two requests with the same tokens and different pictures never share KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from deepinfer.multimodal.prompt import ImagePlaceholder
from deepinfer.types.block_hashes import extend_block_hashes, hash_block


class ImageInputs(msgspec.Struct, frozen=True):
    hashes: list[str]                 # one per image, in prompt order
    offsets: list[int]                # the position of each image's first image token
    num_tokens: int                   # image tokens of each image (mm_tokens_per_image)
    pixels: list[bytes]               # each image's resized RGB pixels, uint8 [H, W, 3]
    shapes: list[tuple[int, int]]     # (H, W) of each

    def __len__(self) -> int:
        return len(self.hashes)

    def placeholders(self) -> list[ImagePlaceholder]:
        return [ImagePlaceholder(offset, self.num_tokens) for offset in self.offsets]

    def pixel_array(self, index: int) -> np.ndarray:
        height, width = self.shapes[index]
        return np.frombuffer(self.pixels[index], dtype=np.uint8).reshape(height, width, 3)

    def overlapping(self, start: int, end: int) -> list[int]:
        """Indices of the images with a token in positions [start, end)."""
        return [i for i, offset in enumerate(self.offsets) if offset < end and offset + self.num_tokens > start]

    def _block_extra(self, block: int, block_size: int) -> bytes:
        """What the images with a token in `block` add to its hash's extra (b"": none)."""
        hit = self.overlapping(block * block_size, (block + 1) * block_size)
        return b"" if not hit else b"\x00images:" + "|".join(self.hashes[i] for i in hit).encode()

    def extend_block_hashes(self, hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                            extra: bytes, root: bytes) -> None:
        """types/block_hashes.extend_block_hashes, with the hashes of the images whose tokens a
        block holds in that block's extra. The chain carries them on: every later block's hash
        depends on the images before it too, as its KV does."""
        num_full = len(token_ids) // block_size
        image_blocks = sorted({b for offset in self.offsets
                               for b in range(offset // block_size, (offset + self.num_tokens - 1) // block_size + 1)})
        while len(hashes) < num_full:
            block = len(hashes)
            image_extra = self._block_extra(block, block_size)
            if image_extra:
                parent = hashes[-1] if hashes else root
                lo = block * block_size
                hashes.append(hash_block(parent, token_ids[lo:lo + block_size], extra + image_extra))
                continue
            # Text-only blocks up to the next block with an image token: the plain chain.
            upto = min([b for b in image_blocks if b > block] + [num_full])
            extend_block_hashes(hashes, token_ids[:upto * block_size], block_size, extra, root)
