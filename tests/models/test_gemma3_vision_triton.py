"""Gemma 3 with images on the Triton attention backend: greedy tokens equal the reference
backend's and transformers' (generate with token_type_ids, the image's tokens attending to each
other both ways), the model driven step by step as tests/models/test_gemma3_vision.py drives it
(ModelSteps: the runner's step inputs, no scheduler), with the whole prompt in one step and in
chunks that never split an image. The prompt's fresh chunks are long enough here for the
backend's SDPA path (fresh_sdpa_min_tokens lowered), which takes no mask: the chunks holding an
image go to the paged prefill kernel with their rows' visible ends instead. The runner's warm-up
runs that kernel with visible ends too. Runs on a GPU, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1) where triton is installed, every Triton kernel of the backend (fused norms,
rotary, activation) included; skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.models.gemma3_mm import Gemma3ForConditionalGeneration
from deepinfer.models.loader import load_model_source
from deepinfer.multimodal.step_images import StepImages
from tests.models.test_gemma3_vision import (
    LAYOUT,
    NEW_TOKENS,
    ModelSteps,
    hf_greedy,
    pixel_values_for,
    prompt_of,
)
from tests.models.tiny_models import build_tiny_vision_checkpoint
from tests.triton_support import DEVICE  # skips this module without a way to run Triton


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, our model loaded from its saved checkpoint), float32."""
    directory = str(tmp_path_factory.mktemp("gemma3_vision_triton"))
    hf = build_tiny_vision_checkpoint(directory)
    source = load_model_source(directory)
    ours = Gemma3ForConditionalGeneration(source.hf_config).eval()
    ours.load_from(source)
    return hf, ours.to(DEVICE)


def chunk_sizes(prompt: list[int]) -> list[int]:
    """Chunked prefill as the scheduler may cut it: a text chunk, then a chunk from just before
    each image (so each image sits inside a chunk on a cached prefix), never splitting one."""
    places = LAYOUT.placeholders(prompt)
    cuts = [0] + [p.offset - 1 for p in places] + [len(prompt)]
    return [b - a for a, b in zip(cuts, cuts[1:])]


# The one-image prompt in one step (its one fresh chunk, SDPA's without the image), the two-image
# one in chunks (a fresh text chunk that stays SDPA's, then each image in a chunk on a prefix):
# each greedy run is a dozen steps through every kernel, slow under the interpreter.
@pytest.mark.parametrize("name,chunked", [("one-image", False), ("two-images", True)],
                         ids=["one-image-whole-prompt", "two-images-chunked"])
def test_triton_greedy_tokens_match_reference_and_transformers(tiny, name, chunked):
    hf, ours = tiny
    prompt = prompt_of(name)
    pixel_values = pixel_values_for(prompt, seed=len(prompt))
    chunks = chunk_sizes(prompt) if chunked else None
    steps = lambda backend: ModelSteps(ours, str(DEVICE), len(prompt) + NEW_TOKENS, backend, fresh_sdpa_min_tokens=8)
    expected = hf_greedy(hf, prompt, pixel_values)
    assert steps("reference").greedy(prompt, pixel_values, chunks) == expected
    assert steps("triton").greedy(prompt, pixel_values, chunks) == expected


def test_triton_prompt_logits_match_reference(tiny):
    """Every row's logits of a two-image prompt in one step, Triton against reference (float32:
    the kernels' products are IEEE)."""
    _, ours = tiny
    prompt = prompt_of("two-images")
    embeds = ours.encode_images(pixel_values_for(prompt, seed=5).to(DEVICE))
    images = StepImages.for_chunk(LAYOUT.placeholders(prompt), embeds, 0, len(prompt))
    logits = {backend: ModelSteps(ours, str(DEVICE), len(prompt), backend, fresh_sdpa_min_tokens=8)
              .forward(prompt, 0, len(prompt), images, every_row=True) for backend in ("reference", "triton")}
    torch.testing.assert_close(logits["triton"], logits["reference"], atol=1e-4, rtol=0)


def test_warm_up_compiles_the_kernels_for_image_rows(tiny, monkeypatch):
    """The runner's warm-up of a model that reads images runs the paged prefill kernel with
    visible ends too (its variants compile at start, not in the first step with an image), and
    without them."""
    from deepinfer.kv_cache.tensors import KVLayout
    from deepinfer.layers.attention import triton_prefill
    from deepinfer.layers.attention.backends.triton import TritonBackend
    from deepinfer.platforms import current_platform
    from deepinfer.worker.start_up_steps import StartUpSteps

    _, ours = tiny
    calls = []
    kernel = triton_prefill.paged_prefill_attention

    def spy(*args, visible_end=None, **kwargs):
        calls.append(visible_end is not None)
        return kernel(*args, visible_end=visible_end, **kwargs)

    monkeypatch.setattr(triton_prefill, "paged_prefill_attention", spy)
    layout = KVLayout.from_specs(ours.kv_cache_specs(torch.float32), 16, torch.float32)
    StartUpSteps(ours, layout, 16, TritonBackend(), current_platform()).warm_up(48, 1)
    assert True in calls and False in calls
