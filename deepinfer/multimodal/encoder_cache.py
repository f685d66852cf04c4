"""The scheduler's side of images: which image tokens a step may compute, which images the
runner encodes for it, and what the encoder cache keeps.

Three rules, applied to every chunk the scheduler cuts (engine/scheduler.py calls `fit` on a
chunk before it allocates KV, and `commit` once the chunk is in the plan):

1. An image is never split across chunks: its tokens attend to each other both ways (Gemma 3;
   multimodal/step_images.py), so a chunk that reaches into an image runs to the image's end, or
   stops before the image when the step's token budget cannot take the rest of it. A chunk may
   start inside an image only where the earlier tokens are cached KV (a prefix hit or SWA replay
   that ends there), computed by a forward that saw the whole image.
2. The encoder budget (max_num_encoder_input_tokens, vLLM's): images whose encoder output is not
   cached cost their tokens; a chunk that would need more than is left stops before that image,
   so a burst of new images spreads over steps while the running decodes go on (they are
   scheduled first and cost no encoder budget).
3. The encoder cache (encoder_cache_size, vLLM's, in image tokens; for one model, tokens times
   hidden_size times the dtype's bytes is its memory): encoder outputs by image hash, least
   recently used out first. The scheduler keeps the book and the runner the tensors
   (multimodal/runner_images.py): each plan says which images to encode and which to drop, so
   the two never disagree, and the budget knows what a step really encodes. An image used by a
   step is not dropped by that step; the cache may run over its size by one step's images and
   comes back under it at the next step's first addition. Size 0 turns the cache off: what a
   step encoded is dropped by the next plan, so every step encodes the images it reads (the
   measure of what the cache saves; a step's own requests still share one encoding).

The runner needs an image's embeddings only in the step that computes its tokens (rule 1), so
nothing has to stay pinned across steps.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.types.request import Request


@dataclass(frozen=True)
class EncodeImage:
    """One image the runner encodes this step: its hash and resized RGB pixels (ImageInputs')."""

    image_hash: str
    pixels: bytes
    shape: tuple[int, int]


@dataclass(frozen=True)
class ImageStepPlan:
    """A step's image work (SchedulerPlan.images): drop `free` from the encoder cache, encode
    `encode` into it, then give each request's chunk the embeddings of `placements[request_id]`:
    (offset, length, hash) of each image with tokens in the chunk."""

    encode: list[EncodeImage] = field(default_factory=list)
    free: list[str] = field(default_factory=list)
    placements: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)


def check_image_limits(tokens_per_image: int, max_num_batched_tokens: int, encoder_budget: int,
                       cache_tokens: int) -> None:
    """ValueError at start when one image cannot fit a step (rule 1 would stall it forever); a
    cache of size 0 is off, not too small."""
    for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_num_encoder_input_tokens", encoder_budget), ("encoder_cache_size", cache_tokens)):
        if value < tokens_per_image and not (name == "encoder_cache_size" and value == 0):
            raise ValueError(f"{name}={value} is less than the {tokens_per_image} tokens of one image of this "
                             f"model: an image is computed in one step, so raise {name} to at least "
                             f"{tokens_per_image}")


class EncoderScheduler:
    def __init__(self, encoder_budget: int, cache_tokens: int) -> None:
        self.encoder_budget = encoder_budget
        self.cache_tokens = cache_tokens
        self.cached: OrderedDict[str, int] = OrderedDict()   # image hash -> tokens, oldest use first
        self.cached_total = 0
        self.num_encoded = 0          # images encoded since start (tests and metrics read it)
        self.num_cache_hits = 0       # images a chunk found in the cache (not encoded again)
        self._start_step()

    def _start_step(self) -> None:
        self._left = self.encoder_budget
        self._step: ImageStepPlan = ImageStepPlan()
        self._in_step: set[str] = set()
        if self.cache_tokens == 0 and self.cached:
            # Off: the last step's outputs leave with the next plan (the runner drops them first),
            # so no later step finds them. That plan reaches the runner even without chunks
            # (engine/step_loop.py, _has_executor_work).
            self._step.free.extend(self.cached)
            self.cached.clear()
            self.cached_total = 0

    # -------------------------------------------------------------------------------- chunks
    def fit(self, request: Request, start: int, num_new: int, token_budget: int) -> int:
        """The tokens of a chunk from `start` (at most `num_new`, or more to finish an image when
        `token_budget` allows) that rules 1 and 2 let this step compute; 0: none this step."""
        images = request.images
        if images is None or num_new <= 0:
            return num_new
        end, left, counted = start + num_new, self._left, set()
        n = images.num_tokens
        for i in images.overlapping(start, end):
            offset = images.offsets[i]
            image_hash = images.hashes[i]
            # Rule 2: an image not cached (nor already encoded for this step) costs its tokens.
            cost = 0 if image_hash in self.cached or image_hash in counted else n
            if end < offset + n and offset + n - start > token_budget:
                cost = None   # rule 1: the rest of the image does not fit this step
            if cost is None or cost > left:
                end = offset   # stop before this image (0 tokens when the chunk starts in it)
                break
            left -= cost
            counted.add(image_hash)
            end = max(end, offset + n)   # rule 1: run to the image's end
        return max(end - start, 0)

    def commit(self, request: Request, start: int, num_tokens: int) -> None:
        """A chunk is in the plan: its images are encoded (or found in the cache) for this step."""
        images = request.images
        if images is None:
            return
        hit = images.overlapping(start, start + num_tokens)
        if not hit:
            return
        placements = self._step.placements.setdefault(request.request_id, [])
        for i in hit:
            image_hash = images.hashes[i]
            placements.append((images.offsets[i], images.num_tokens, image_hash))
            self._in_step.add(image_hash)
            if image_hash in self.cached:
                self.cached.move_to_end(image_hash)
                self.num_cache_hits += 1
                continue
            self._left -= images.num_tokens
            self.num_encoded += 1
            self._step.encode.append(EncodeImage(image_hash, images.pixels[i], tuple(images.shapes[i])))
            self._add(image_hash, images.num_tokens)

    def _add(self, image_hash: str, tokens: int) -> None:
        self.cached[image_hash] = tokens
        self.cached_total += tokens
        for old in list(self.cached):
            if self.cached_total <= self.cache_tokens:
                break
            if old in self._in_step:
                continue   # this step reads it
            self.cached_total -= self.cached.pop(old)
            self._step.free.append(old)

    def take_plan(self) -> ImageStepPlan | None:
        """This step's image work for the plan (None: none), and a fresh budget for the next."""
        plan = self._step if (self._step.encode or self._step.free or self._step.placements) else None
        self._start_step()
        return plan


def image_scheduler(config, hf_config: dict) -> EncoderScheduler:
    """The EncoderScheduler of an engine whose model reads images (`config`: its EngineConfig,
    batch limits filled in), after checking that one image fits a step."""
    from deepinfer.multimodal.prompt import ImageTokenLayout

    tokens = ImageTokenLayout.from_config(hf_config).tokens_per_image
    batched = config.scheduler.max_num_batched_tokens
    budget, cache = config.multimodal.encoder_budget(batched), config.multimodal.cache_tokens(batched)
    check_image_limits(tokens, batched, budget, cache)
    return EncoderScheduler(budget, cache)
