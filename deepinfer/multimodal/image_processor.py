"""Image bytes to the pixel_values a vision tower reads, as the checkpoint's HF image processor
makes them, and the image's hash.

Why a re-implementation and not transformers: transformers is a test-time reference here, never a
runtime need (DESIGN.md, decision 6). What is matched is transformers' Gemma3ImageProcessor on its
PIL backend (`Gemma3ImageProcessorPil`, what transformers falls back to without torchvision), with
pan-and-scan off, its default and the Gemma3Processor's:

    convert to RGB     an image with alpha (or a palette transparency) is composited onto white
    resize             PIL's `Image.resize` to size["height"] x size["width"] with `resample`
                       (BILINEAR by default), on the uint8 RGB image
    rescale            uint8 -> float64 * rescale_factor (1/255) -> float32
    normalize          (x - mean) / std in float32, mean = std = 0.5 per channel by default

The torchvision backend transformers prefers when torchvision is installed resizes tensors with
its own antialiased kernel, whose values are close to PIL's but not the same; the PIL backend is
the one matched (the test compares with it, within float32 rounding).

Settings come from the checkpoint's preprocessor_config.json where it has one (a null field keeps
the default); without one, the Gemma 3 defaults with the tower's own image_size (a SigLIP tower
reads no other size: its position embeddings are one per patch of that size).

The hash (ImageProcessor.image_hash) covers the decoded RGB pixels, their size and every setting
that changes pixel_values, so two requests with the same picture in different files (PNG, JPEG
re-encoded to identical pixels) share one encoder output, and a change of settings never reuses
an old one. The encoder cache adds the model's identity to it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

if TYPE_CHECKING:
    from PIL import Image

# The most pixels (width * height) a decoded image may have: decoding allocates 3 bytes a pixel
# (4 with alpha) before any resize, so this bounds what one request can make the server hold.
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024

# PIL's resampling filters by the integer code preprocessor_config.json stores (transformers'
# PILImageResampling uses the same codes).
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def _pil():
    """Pillow, imported where an image is first touched (a text-only server never needs it)."""
    try:
        from PIL import Image
    except ImportError as e:   # a runtime dependency; this only happens in a broken install
        raise ImportError("decoding images needs Pillow: pip install 'pillow>=10'") from e
    return Image


@dataclass(frozen=True)
class ImageProcessorSettings:
    """What decides pixel_values; the defaults are transformers' Gemma3ImageProcessor's."""

    height: int = 224
    width: int = 224
    resample: int = 2                  # PIL's BILINEAR
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        if self.resample not in RESAMPLE_NAMES:
            raise ValueError(f"resample must be one of PIL's filter codes {sorted(RESAMPLE_NAMES)}, "
                             f"got {self.resample!r}")
        if self.height <= 0 or self.width <= 0:
            raise ValueError(f"image size must be positive, got {self.height}x{self.width}")
        for name in ("image_mean", "image_std"):
            if len(getattr(self, name)) != 3:
                raise ValueError(f"{name} needs one value per RGB channel, got {getattr(self, name)!r}")
        if any(s == 0 for s in self.image_std):
            raise ValueError(f"image_std has a zero: {self.image_std!r}")

    @classmethod
    def from_preprocessor_config(cls, config: dict[str, Any], default_size: int | None = None
                                 ) -> ImageProcessorSettings:
        """Settings from a preprocessor_config.json dict; a missing or null field keeps the default
        (`default_size` for the size, when given). Pan-and-scan, which makes extra crops of a
        wide image and more image tokens, is refused if switched on: it is not implemented."""
        if config.get("do_pan_and_scan"):
            raise ValueError("preprocessor_config.json sets do_pan_and_scan: pan-and-scan crops are not supported "
                             "(set it to false or null)")
        fields: dict[str, Any] = {}
        if default_size is not None:
            fields["height"] = fields["width"] = int(default_size)
        size = config.get("size")
        if size is not None:
            if isinstance(size, int):
                size = {"height": size, "width": size}
            if not isinstance(size, dict) or not {"height", "width"} <= set(size):
                raise ValueError(f"preprocessor_config.json size must be {{'height': H, 'width': W}}, got {size!r}")
            fields["height"], fields["width"] = int(size["height"]), int(size["width"])
        for name in ("do_resize", "do_rescale", "do_normalize"):
            if config.get(name) is not None:
                fields[name] = bool(config[name])
        if config.get("resample") is not None:
            fields["resample"] = int(config["resample"])
        if config.get("rescale_factor") is not None:
            fields["rescale_factor"] = float(config["rescale_factor"])
        for name in ("image_mean", "image_std"):
            value = config.get(name)
            if value is not None:
                fields[name] = tuple(float(v) for v in (value if isinstance(value, list) else [value] * 3))
        return cls(**fields)

    def fingerprint(self) -> str:
        """Every setting, canonically: part of each image's hash."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _format_by_signature(head: bytes) -> str | None:
    """The format whose signature `head` starts with, by Pillow's own checks, or None."""
    Image = _pil()
    Image.init()
    for fmt, (_, accept) in Image.OPEN.items():
        try:
            if accept is not None and accept(head):
                return fmt
        except Exception:   # a plugin's check on a short prefix: no answer is no match
            continue
    return None


class ImageProcessor:
    """Decodes images and makes pixel_values [n, 3, height, width] (float32) from them."""

    def __init__(self, settings: ImageProcessorSettings | None = None,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        self.settings = settings or ImageProcessorSettings()
        self.max_pixels = max_pixels
        self._fingerprint = self.settings.fingerprint().encode()

    @classmethod
    def from_pretrained(cls, directory: str | None, hf_config: dict[str, Any] | None = None,
                        max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageProcessor:
        """The processor of a checkpoint: its preprocessor_config.json if the directory has one,
        else the defaults; the size defaults to the tower's image_size (hf_config's vision_config)."""
        vision = (hf_config or {}).get("vision_config") or {}
        config: dict[str, Any] = {}
        path = os.path.join(directory, "preprocessor_config.json") if directory else None
        if path and os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"cannot read {path}: {e}") from e
        return cls(ImageProcessorSettings.from_preprocessor_config(config, vision.get("image_size")), max_pixels)

    # -- decoding --------------------------------------------------------------------------------

    def decode(self, data: bytes) -> Image.Image:
        """The image in `data` (any format Pillow reads) as an RGB PIL image, its first frame for
        an animation. ValueError says what is wrong: not an image, too many pixels (the limit is
        checked from the header, before the pixels are decoded), truncated or corrupt data."""
        Image = _pil()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"image data must be bytes, got {type(data).__name__}")
        if len(data) == 0:
            raise ValueError("not an image: the data is empty")
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            raise ValueError(f"image too large: {e} (this server's limit is {self.max_pixels} pixels)") from e
        except (Image.UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            fmt = _format_by_signature(bytes(data[:16]))
            if fmt is not None:   # it starts as an image of a known format, and breaks off or goes wrong
                raise ValueError(f"truncated or corrupt {fmt} data ({len(data)} bytes): {e}") from e
            raise ValueError(f"not an image: no format Pillow reads starts like this ({len(data)} bytes, "
                             f"first bytes 0x{bytes(data[:8]).hex()})") from e
        self._check_size(image.width, image.height, image.format)
        try:
            with warnings.catch_warnings():
                # The pixel count was checked above against our own limit.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image.load()
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise ValueError(f"truncated or corrupt {image.format or 'image'} data ({len(data)} bytes): {e}") from e
        return self.to_rgb(image)

    def _check_size(self, width: int, height: int, fmt: str | None) -> None:
        if width <= 0 or height <= 0:
            raise ValueError(f"empty image: {fmt or 'image'} of {width}x{height} pixels")
        if width * height > self.max_pixels:
            raise ValueError(f"image too large: {width}x{height} = {width * height} pixels, over the limit of "
                             f"{self.max_pixels} pixels")

    @staticmethod
    def to_rgb(image: Image.Image) -> Image.Image:
        """RGB as transformers' convert_to_rgb makes it: transparency composited onto white."""
        Image = _pil()
        if image.mode == "RGB":
            return image
        try:
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                rgba = image.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                return Image.alpha_composite(white, rgba).convert("RGB")
            return image.convert("RGB")
        except (ValueError, OSError) as e:
            raise ValueError(f"cannot convert an image of pixel mode {image.mode!r} to RGB: {e}") from e

    # -- pixel_values ----------------------------------------------------------------------------

    def preprocess(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """pixel_values [len(images), 3, H, W] float32 of decoded images (PIL images of any mode;
        decode() gives RGB ones)."""
        if not images:
            raise ValueError("no images to preprocess")
        arrays = [self._pixels(self.to_rgb(image)) for image in images]
        shapes = {a.shape for a in arrays}
        if len(shapes) > 1:   # only without do_resize
            raise ValueError(f"images of different sizes cannot be batched without resizing: {sorted(shapes)}")
        return torch.from_numpy(np.stack(arrays))

    def _pixels(self, image: Image.Image) -> np.ndarray:
        """One RGB image as float32 [3, H, W], in transformers' order of operations and dtypes:
        resize the uint8 image, rescale through float64, normalize in float32."""
        return self.normalize(self.resized(image))

    def resized(self, image: Image.Image) -> np.ndarray:
        """The first half of `_pixels`: the RGB image resized, uint8 [H, W, 3]. What crosses from
        the front end to the engine core (a quarter of the float32 pixel_values' bytes)."""
        s = self.settings
        image = self.to_rgb(image)
        self._check_size(image.width, image.height, None)
        if s.do_resize:   # PIL takes (width, height); to the image's own size it is a copy
            image = image.resize((s.width, s.height), resample=s.resample)
        return np.asarray(image, dtype=np.uint8)

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """The second half: uint8 [H, W, 3] -> float32 [3, H, W], rescaled and normalized."""
        s = self.settings
        if s.do_rescale:
            # float64 first, then float32: transformers' rescale (an exact product in float64
            # rounded once), so the values agree to the last bit.
            values = (pixels.astype(np.float64) * s.rescale_factor).astype(np.float32)
        else:
            values = pixels.astype(np.float32)
        if s.do_normalize:
            mean = np.asarray(s.image_mean, dtype=np.float32)
            std = np.asarray(s.image_std, dtype=np.float32)
            values = (values - mean) / std
        return np.ascontiguousarray(values.transpose(2, 0, 1))

    def __call__(self, data: Sequence[bytes]) -> torch.Tensor:
        """pixel_values of encoded images (bytes each)."""
        return self.preprocess([self.decode(d) for d in data])

    # -- identity --------------------------------------------------------------------------------

    def image_hash(self, image: Image.Image) -> str:
        """A stable hex digest (XXH3-128) of a decoded image's RGB pixels, its size and these
        settings: the same picture gives the same hash whatever file it came in, in any process."""
        rgb = self.to_rgb(image)
        digest = xxhash.xxh3_128()
        digest.update(self._fingerprint)
        digest.update(f"|{rgb.width}x{rgb.height}|".encode())
        digest.update(rgb.tobytes())
        return digest.hexdigest()
