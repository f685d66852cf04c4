"""Attention inside an image on the Triton backend (multimodal/step_images.py, TritonBackend's
with_visible_end), through the real step inputs, against the reference backend's masks.

A step mixes a decode, fresh chunks and chunks on cached prefixes, with and without images; the
chunks the backend would send to SDPA's tiled kernels (long fresh ones) or to cuDNN's (long ones
on long prefixes; the shapes that take that path are lowered here so that tiny chunks do) go to
the paged prefill kernel once they hold an image's rows, and the others stay where they were.
The layer's output equals the reference backend's, with full attention and with sliding windows
shorter and longer than an image. Runs on a GPU, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1) where triton is installed; skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec, group_layers
from deepinfer.layers.attention import Attention, forward_context
from deepinfer.layers.attention.backends.base import AttentionBackend
from deepinfer.multimodal.step_images import ImageSpan, image_attention_metadata
from deepinfer.worker.input_batch import build_step_inputs
from deepinfer.worker.request_states import StepChunk
from tests.triton_support import DEVICE, INTERPRETED  # skips this module without a way to run Triton

BS = 16
MIN_FRESH = 8   # fresh chunks this long go to SDPA here (the engine's threshold is 512)
EXTEND_SHAPES = ((16, 32),)   # chunks of >= 16 queries on >= 32 cached keys go to cuDNN's path here
# (request, cached tokens, new tokens, images as (first token of the chunk, length)); images end
# inside their chunk (the scheduler's invariant). "fresh-image" and "extend-image" would leave
# the paged kernel without their images; "fresh" and "extend" stay where build_metadata put them.
CHUNKS = [
    ("decode", 30, 1, []),
    ("fresh-image", 0, 20, [(2, 18)]),        # an image running to the chunk's end
    ("fresh", 0, 24, []),
    ("extend-image", 40, 20, [(0, 16)]),      # an image at the chunk's start
    ("extend", 48, 16, []),
    ("prefix-image", 20, 29, [(3, 5), (10, 19)]),   # two images, one longer than a key tile
]


def _dtypes():
    return [torch.float32, torch.float16 if INTERPRETED else torch.bfloat16]


def tolerance(dtype):
    return 2e-4 if dtype == torch.float32 else 2e-2


def step_chunks() -> list[StepChunk]:
    chunks, next_block = [], 1
    for name, start, num_tokens, _ in CHUNKS:
        blocks = list(range(next_block, next_block + -(-(start + num_tokens) // BS)))
        next_block += len(blocks)
        chunks.append(StepChunk(name, start, num_tokens, [blocks], sample=True))
    return chunks


def image_spans(meta) -> list[ImageSpan]:
    """The step's image rows as the runner hands them to the model (ImageSpan: step rows)."""
    prefill_names = [name for name, _, n, _ in CHUNKS if n > 1]
    spans = []
    for (row_start, _), name in zip(meta.prefill_query_ranges, prefill_names):
        _, start, _, images = next(c for c in CHUNKS if c[0] == name)
        spans += [ImageSpan(row_start + first, length, start + first + length) for first, length in images]
    return spans


def run(backend, window, dtype, seed=0, heads=4, kv_heads=2, head_dim=32):
    """The layer's output on the step with its images, the metadata it ran with, and the
    metadata build_metadata made."""
    torch.manual_seed(seed)
    spec = (SlidingWindowSpec(kv_heads, head_dim, dtype, dtype, sliding_window=window) if window
            else FullAttentionSpec(kv_heads, head_dim, dtype, dtype))
    chunks = step_chunks()
    num_blocks = 1 + sum(len(c.block_ids[0]) for c in chunks)
    caches = [(torch.randn(num_blocks * BS, kv_heads, head_dim, device=DEVICE).to(dtype),
               torch.randn(num_blocks * BS, kv_heads, head_dim, device=DEVICE).to(dtype))]
    num_tokens = sum(c.num_tokens for c in chunks)
    q = torch.randn(num_tokens, heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    token_ids = {c.request_id: [1] * (c.start + c.num_tokens) for c in chunks}
    inputs = build_step_inputs(chunks, token_ids, group_layers([spec]), BS, [0], [0], caches, DEVICE,
                               backend=backend, fresh_sdpa_min_tokens=MIN_FRESH)
    meta = image_attention_metadata(inputs.attention, image_spans(inputs.attention))
    layer = Attention(0, heads, kv_heads, head_dim, scale=head_dim ** -0.5, sliding_window=window)
    with forward_context(meta):
        return layer(q, k, v).float(), meta, inputs.attention


def chunk_index(name: str) -> int:
    return [c[0] for c in CHUNKS if c[2] > 1].index(name)


@pytest.mark.parametrize("window", [None, 12, 30], ids=["full", "window<image", "window>image"])
@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: str(d)[6:])
def test_image_rows_match_reference(window, dtype, monkeypatch):
    from deepinfer.layers.attention import sdpa_extend

    monkeypatch.setattr(sdpa_extend, "EXTEND_MIN_SHAPES", EXTEND_SHAPES)
    ref, ref_meta, _ = run("reference", window, dtype)
    out, meta, built = run("triton", window, dtype)
    assert ref_meta is not built and meta is not built   # new objects: the step's own are unchanged
    group, before = meta.groups[0], built.groups[0]
    ranges = built.prefill_query_ranges
    kernel = [] if group.kernel_prefill_rows is None else group.kernel_prefill_rows.tolist()
    with_images = [chunk_index(name) for name, *_, images in CHUNKS if images]
    if window is None or window >= 20:   # the fresh image chunk was SDPA's before
        assert ranges[chunk_index("fresh-image")] in before.sdpa_prefill_ranges
    if window is None:                    # and the extend image chunk cuDNN's
        assert [e[2] for e in before.extend_chunks] == [chunk_index("extend-image"), chunk_index("extend")]
        assert [e[2] for e in group.extend_chunks] == [chunk_index("extend")]
    assert set(with_images) <= set(kernel)
    assert all(ranges[i] not in group.sdpa_prefill_ranges for i in with_images)
    fresh_sdpa = window is None or window >= 24
    assert (ranges[chunk_index("fresh")] in group.sdpa_prefill_ranges) == fresh_sdpa
    assert meta.prefill_visible_end is not None and built.prefill_visible_end is None
    torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=tolerance(dtype))


def test_visible_ends_of_the_step():
    """Each prefill row's visible end: its position + 1, its image's end on an image's rows."""
    _, meta, _ = run("triton", None, torch.float32)
    expected = []
    for _, start, num_tokens, images in CHUNKS[1:]:
        ends = list(range(start + 1, start + num_tokens + 1))
        for first, length in images:
            ends[first:first + length] = [start + first + length] * length
        expected += ends
    assert meta.prefill_visible_end.tolist() == expected


def test_one_row_images_leave_the_metadata_as_built():
    """An image of one row ends at it (a decode-like image token): the step's metadata as built,
    the prefill kernel compiled without visible ends."""
    chunks = [StepChunk("r", 5, 12, [[1, 2]], sample=True)]
    spec = FullAttentionSpec(2, 32, torch.float32, torch.float32)
    caches = [(torch.zeros(3 * BS, 2, 32, device=DEVICE), torch.zeros(3 * BS, 2, 32, device=DEVICE))]
    inputs = build_step_inputs(chunks, {"r": [1] * 17}, group_layers([spec]), BS, [0], [0], caches, DEVICE,
                               backend="triton")
    assert image_attention_metadata(inputs.attention, [ImageSpan(3, 1, 9)]) is inputs.attention


def test_a_backend_without_the_hook_is_refused(monkeypatch):
    from deepinfer.layers.attention.backends.triton import TritonBackend

    monkeypatch.setattr(TritonBackend, "with_visible_end", AttentionBackend.with_visible_end)
    with pytest.raises(ValueError, match="cannot let an image's tokens attend"):
        run("triton", None, torch.float32)
