"""The runner's side of images: the encoder cache's tensors, the encoder stage, and each step's
StepImages for the model's forward.

The scheduler decides (multimodal/encoder_cache.py); this follows its plan, step by step, in
plan order: drop what the plan frees, encode what it lists (one batch through the model's
`encode_images`, after the exact rescale and normalize of the pixels the request carried), then
hand the forward the embeddings of each chunk's image rows. The cache is a dict by image hash:
its size is the scheduler's to keep, so the two never disagree on what is here.

The forward of a step with image rows runs eagerly: a CUDA graph replays decode rows with
token embeddings, and an image's rows must take the encoder's (the runner does not replay such
a step; decode steps stay text-only and keep their graphs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deepinfer.multimodal.image_processor import ImageProcessor
from deepinfer.multimodal.prompt import ImagePlaceholder
from deepinfer.multimodal.step_images import StepImages

if TYPE_CHECKING:
    from deepinfer.multimodal.encoder_cache import ImageStepPlan


class RunnerImages:
    def __init__(self, model: Any, processor: ImageProcessor) -> None:
        self.model = model
        self.processor = processor
        self.cache: dict[str, torch.Tensor] = {}   # image hash -> [tokens, hidden] on the model's device
        self._plan: ImageStepPlan | None = None

    @classmethod
    def for_model(cls, model: Any, hf_config: dict, source: Any) -> RunnerImages | None:
        """The runner's images for a model with an encoder stage (encode_images), else None."""
        if not hasattr(model, "encode_images"):
            return None
        return cls(model, ImageProcessor.from_pretrained(getattr(source, "path", None), hf_config))

    def begin(self, plan: ImageStepPlan | None) -> None:
        """A plan arrived: apply its cache work now, keep its placements for the step's forward."""
        self._plan = plan
        if plan is None:
            return
        for image_hash in plan.free:
            self.cache.pop(image_hash, None)
        by_shape: dict[tuple[int, int], list] = {}
        for item in plan.encode:   # one batch per pixel shape (one in all, unless resizing is off)
            by_shape.setdefault(tuple(item.shape), []).append(item)
        for (height, width), items in by_shape.items():
            pixels = [np.frombuffer(item.pixels, dtype=np.uint8).reshape(height, width, 3) for item in items]
            pixel_values = torch.from_numpy(np.stack([self.processor.normalize(p) for p in pixels]))
            embeds = self.model.encode_images(pixel_values)
            for item, embed in zip(items, embeds):
                self.cache[item.image_hash] = embed

    def for_chunks(self, chunks: list) -> RunnerImages | None:
        """self when the plan places images in some of these chunks (the step has image rows),
        else None; the forward then calls `step_images` on its inputs."""
        plan = self._plan
        if plan is None or not any(c.request_id in plan.placements for c in chunks):
            return None
        return self

    def step_images(self, inputs: Any) -> StepImages | None:
        """The step's image rows and their embeddings (worker/input_batch.StepInputs' row order)."""
        plan, self._plan = self._plan, None
        parts = []
        for chunk, last in zip(inputs.chunks, inputs.last_token_index):
            places = plan.placements.get(chunk.request_id) if plan is not None else None
            if not places:
                continue
            first_row = last - chunk.num_tokens + 1
            parts.append(StepImages.for_chunk([ImagePlaceholder(offset, length) for offset, length, _ in places],
                                              [self.cache[image_hash] for _, _, image_hash in places],
                                              chunk.start, chunk.num_tokens, first_row))
        return StepImages.concat(parts)
