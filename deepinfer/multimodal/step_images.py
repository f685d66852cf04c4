"""One forward step's images: which of its rows are image tokens, their embeddings, and the
attention inside an image.

The language model's forward takes the step's rows flat (decodes first, then each prefill chunk;
worker/input_batch.py). `StepImages` says which of those rows hold image tokens (spans of
consecutive rows, each within one image) and carries their embeddings in row order; the model
puts them in place of the token embeddings of those rows (models/gemma3_mm.py).

Attention inside an image (Gemma 3). transformers 5.25 gives an image's tokens bidirectional
attention among themselves when the prompt comes with `token_type_ids` (Gemma3Processor always
returns them, and generate passes them to the prefill, not to later decode steps): the mask is
causal OR same-image for full-attention layers, and (causal OR same-image) AND the sliding window
for sliding layers. A query's keys ahead of it are then those of its own image that follow it;
the sliding window never removes them (it bounds keys from below). So per query row:

    may attend to key kv  <=>  causal mask (window, floors as the backend built them)
                               OR  q < kv < end of q's image (q an image token)

`image_attention_metadata` turns the second term into data: per prefill row of the step, the key
position (exclusive) up to which the row may see (`visible_ends`: q + 1 on a causal row, the
image's end on an image's row), and hands it to the step's backend, which returns a new metadata
object (AttentionBackend.with_visible_end; the step's own is left as it is). The reference and CPU
backends OR the keys ahead into their explicit prefill masks. The Triton backend sends the chunks
holding such rows to its paged prefill kernel (never to SDPA's or cuDNN's causal kernels, which
take no mask), whose launch reads the visible end of each row (triton_prefill.py). Decode rows
never need it: an image token decoded alone is its image's last. A backend without the hook
refuses the step with a ValueError naming the backends that run it.

The invariant this needs of the scheduler: an image's tokens that a step computes must reach the
image's end in that step (ImageSpan.image_end), because a query can only attend to keys the step
itself writes or the cache already holds. A span may start inside its image only where the
image's earlier tokens are cached from a forward that saw the whole image (a prefix hit on the
same image); splitting an image across prefill chunks gives its first part wrong keys, and is
refused here when the split shows (a span that stops before its image's end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.multimodal.prompt import ImagePlaceholder

if TYPE_CHECKING:
    from deepinfer.layers.attention.backends.base import AttentionMetadata


@dataclass(frozen=True)
class ImageSpan:
    """Consecutive rows of a step holding consecutive tokens of one image."""

    first_row: int    # in the step's flat token axis
    num_rows: int
    image_end: int    # the position (exclusive) where the image's tokens end in its request

    @property
    def end_row(self) -> int:
        return self.first_row + self.num_rows


@dataclass
class StepImages:
    """The image rows of one step and their embeddings ([sum of num_rows, hidden], span order)."""

    spans: list[ImageSpan]
    embeds: torch.Tensor

    def __post_init__(self) -> None:
        total = sum(s.num_rows for s in self.spans)
        if self.embeds.dim() != 2 or self.embeds.shape[0] != total:
            raise ValueError(f"the spans cover {total} rows but the embeddings are {tuple(self.embeds.shape)}")

    def rows(self, device: torch.device) -> torch.Tensor:
        """Row indices of every image token of the step, in the order of `embeds`."""
        rows = np.concatenate([np.arange(s.first_row, s.end_row) for s in self.spans]) if self.spans else []
        return torch.as_tensor(rows, dtype=torch.long).to(device)

    @classmethod
    def for_chunk(cls, placeholders: Sequence[ImagePlaceholder], image_embeds: torch.Tensor | Sequence[torch.Tensor],
                  start: int, num_tokens: int, first_row: int = 0) -> StepImages:
        """The images of one request's chunk, positions [start, start + num_tokens), whose first
        token is the step's row `first_row`: for each image overlapping the chunk, the rows of its
        tokens there and the matching slice of its embeddings. `image_embeds[i]` are image i's
        ([tokens_per_image, hidden]; a [n, tokens, hidden] tensor from encode_images works)."""
        spans, parts = [], []
        end = start + num_tokens
        for i, place in enumerate(placeholders):
            lo, hi = max(place.offset, start), min(place.end, end)
            if lo >= hi:
                continue
            embeds = image_embeds[i]
            if embeds.shape[0] != place.length:
                raise ValueError(f"image {i} has {embeds.shape[0]} embeddings for {place.length} image tokens")
            spans.append(ImageSpan(first_row + lo - start, hi - lo, place.end))
            parts.append(embeds[lo - place.offset:hi - place.offset])
        if not parts:
            hidden = image_embeds[0].shape[-1] if len(image_embeds) else 0
            return cls([], torch.empty(0, hidden))
        return cls(spans, torch.cat(parts))

    @classmethod
    def concat(cls, parts: Sequence[StepImages]) -> StepImages | None:
        """Several requests' StepImages (spans already in step rows) as the step's one; None if
        no part has an image row."""
        parts = [p for p in parts if p.spans]
        if not parts:
            return None
        return cls([s for p in parts for s in p.spans], torch.cat([p.embeds for p in parts]))


def _span_positions(meta: AttentionMetadata, span: ImageSpan) -> tuple[int | None, int, int]:
    """(prefill chunk index or None for a decode row, first position, chunk end position)."""
    step = meta.step
    if step is None:
        raise ValueError("the step's attention metadata carries no layout to place image rows in")
    if span.end_row <= meta.num_decode_tokens:
        if span.num_rows != 1:
            raise ValueError(f"image rows {span.first_row}..{span.end_row - 1} span several decode rows")
        position = step.decodes[span.first_row].start
        return None, position, position + 1
    for j, (row_start, row_end) in enumerate(meta.prefill_query_ranges):
        if row_start <= span.first_row and span.end_row <= row_end:
            start = step.prefills[j].start
            return j, start + span.first_row - row_start, start + row_end - row_start
    raise ValueError(f"image rows {span.first_row}..{span.end_row - 1} are not within one chunk of the step")


def image_attention_metadata(meta: AttentionMetadata, spans: Sequence[ImageSpan]) -> AttentionMetadata:
    """The step's metadata with each image's tokens attending to the later tokens of their image
    (the module docstring's rule), built by its backend (AttentionBackend.with_visible_end) as a
    new object; `meta` itself unchanged. Spans of one row need nothing (their image ends at
    them): a step whose spans are all such gets `meta` back."""
    bidirectional: dict[int, list[tuple[int, int]]] = {}    # prefill chunk -> [(first, end) positions]
    for span in spans:
        chunk, first, chunk_end = _span_positions(meta, span)
        last = first + span.num_rows   # the position after the span's last row
        if span.image_end != last:
            where = "its step's chunk ends" if last == chunk_end else "the span ends"
            raise ValueError(f"an image's tokens up to position {span.image_end} are split: {where} at position "
                             f"{last}. Schedule an image's remaining tokens in one chunk (its tokens attend to "
                             "each other both ways)")
        if span.num_rows > 1:
            bidirectional.setdefault(chunk, []).append((first, last))
    if not bidirectional:
        return meta
    seeing = meta.backend.with_visible_end(meta, visible_ends(meta, bidirectional), sorted(bidirectional))
    if seeing is None:
        raise ValueError(f"the {meta.backend.name} attention backend cannot let an image's tokens attend to the "
                         "later tokens of their image (bidirectional in Gemma 3); run vision models with "
                         "attention_backend='triton' (CUDA), 'reference' (CPU or CUDA) or 'cpu'")
    return seeing


def visible_ends(meta: AttentionMetadata, bidirectional: dict[int, list[tuple[int, int]]]) -> np.ndarray:
    """[prefill rows] int32 (rows counted from the step's first prefill row): the key position
    (exclusive) up to which each row may see. q + 1 for a causal row; the end of its image for
    an image's token, whose image ends in its chunk (checked by the caller), so the entry never
    passes the chunk's KV length. `bidirectional`: per prefill chunk, its multi-row images as
    (first, end) positions."""
    step, n_dec = meta.step, meta.num_decode_tokens
    ends = np.zeros(meta.num_tokens - n_dec, dtype=np.int32)
    for (row_start, row_end), chunk in zip(meta.prefill_query_ranges, step.prefills):
        ends[row_start - n_dec:row_end - n_dec] = np.arange(chunk.start + 1, chunk.start + 1 + row_end - row_start)
    for j, image_spans in bidirectional.items():
        offset = meta.prefill_query_ranges[j][0] - n_dec - step.prefills[j].start   # position -> row
        for first, last in image_spans:
            ends[first + offset:last + offset] = last
    return ends
