"""The runner's side of images: the encoder cache's tensors, the encoder stage, and each step's
StepImages for the model's forward.

The scheduler decides (multimodal/encoder_cache.py); this follows its plan, step by step, in
plan order: drop what the plan frees, encode what it lists (one batch through the model's
`encode_images`, after the exact rescale and normalize of the pixels the request carried), then
hand the forward the embeddings of each chunk's image rows. The cache is a dict by image hash:
its size is the scheduler's to keep, so the two never disagree on what is here.

With a persistent store (`kv_store`, E/P/D: an encode instance wrote the outputs there), an
image the plan lists to encode is first looked up in the store (multimodal/encoder_store.py):
found and valid, it is loaded instead; absent, damaged or written for other settings, it is
encoded here. The memory cache stays in front: the scheduler lists only images it does not hold.

The forward of a step with image rows runs eagerly: a CUDA graph replays decode rows with
token embeddings, and an image's rows must take the encoder's (the runner does not replay such
a step; decode steps stay text-only and keep their graphs).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deepinfer.multimodal.image_processor import ImageProcessor
from deepinfer.multimodal.prompt import ImagePlaceholder
from deepinfer.multimodal.step_images import StepImages

if TYPE_CHECKING:
    from deepinfer.multimodal.encoder_cache import ImageStepPlan
    from deepinfer.multimodal.encoder_store import EncoderStore


class RunnerImages:
    def __init__(self, model: Any, processor: ImageProcessor, store: EncoderStore | None = None) -> None:
        self.model = model
        self.processor = processor
        self.store = store
        self.cache: dict[str, torch.Tensor] = {}   # image hash -> [tokens, hidden] on the model's device
        self._plan: ImageStepPlan | None = None
        self.num_encoded = 0          # images run through the vision tower here (tests read it)
        self.encode_seconds = 0.0

    @classmethod
    def for_model(cls, model: Any, hf_config: dict, source: Any, config: Any = None) -> RunnerImages | None:
        """The runner's images for a model with an encoder stage (encode_images), else None;
        `config` (EngineConfig) with a kv_store: encoder outputs are looked up there first."""
        if not hasattr(model, "encode_images"):
            return None
        processor = ImageProcessor.from_pretrained(getattr(source, "path", None), hf_config)
        store = None
        if config is not None and config.cache.kv_store:
            from deepinfer.kv_cache.store.factory import open_kv_store
            from deepinfer.multimodal.encoder_store import EncoderStore

            store = EncoderStore.for_model(open_kv_store(config), source, model, processor,
                                           model.model.embed_tokens.weight.dtype)
        return cls(model, processor, store)

    def counters(self) -> dict[str, float]:
        """The runner's encoder counters for /metrics (the scheduler adds the cache's hits)."""
        out = {"encoded": self.num_encoded, "encode_seconds": self.encode_seconds}
        if self.store is not None:
            out.update(self.store.counters())
        return out

    def begin(self, plan: ImageStepPlan | None) -> None:
        """A plan arrived: apply its cache work now, keep its placements for the step's forward."""
        self._plan = plan
        if plan is None:
            return
        for image_hash in plan.free:
            self.cache.pop(image_hash, None)
        by_shape: dict[tuple[int, int], list] = {}
        for item in plan.encode:   # one batch per pixel shape (one in all, unless resizing is off)
            loaded = self.store.load(item.image_hash) if self.store is not None else None
            if loaded is not None:
                self.cache[item.image_hash] = loaded.to(self.model.model.embed_tokens.weight.device)
                continue
            by_shape.setdefault(tuple(item.shape), []).append(item)
        for (height, width), items in by_shape.items():
            began = time.perf_counter()
            pixels = [np.frombuffer(item.pixels, dtype=np.uint8).reshape(height, width, 3) for item in items]
            pixel_values = torch.from_numpy(np.stack([self.processor.normalize(p) for p in pixels]))
            embeds = self.model.encode_images(pixel_values)
            for item, embed in zip(items, embeds):
                self.cache[item.image_hash] = embed
            self.num_encoded += len(items)
            self.encode_seconds += time.perf_counter() - began

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
