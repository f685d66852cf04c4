"""Gemma 3 with images against transformers, on a tiny random Gemma3ForConditionalGeneration
saved with save_pretrained and loaded through deepinfer's loader (tests/models/tiny_models.py):

- the image processor's pixel_values equal Gemma3ImageProcessor's (its PIL backend) for images of
  several sizes and pixel modes, and its settings come from preprocessor_config.json;
- the vision tower's and the projector's outputs agree within 1e-4 in float32;
- greedy tokens equal transformers' generate for prompts with 1 and 2 images, our model driven
  step by step at the model level (the runner's step inputs and reference attention backend, no
  scheduler), with the whole prompt in one step and with chunked prefill;
- the image tokens attend to each other both ways, as transformers does with token_type_ids;
- bad images raise ValueErrors that say what is wrong.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer.kv_cache.tensors import KVLayout
from deepinfer.layers.attention import forward_context
from deepinfer.models.gemma3_mm import Gemma3ForConditionalGeneration, canonical_weight_name
from deepinfer.models.loader import load_model_source
from deepinfer.models.registry import model_class
from deepinfer.multimodal.image_processor import ImageProcessor, ImageProcessorSettings
from deepinfer.multimodal.prompt import ImagePlaceholder, ImageTokenLayout
from deepinfer.multimodal.step_images import StepImages
from deepinfer.worker.input_batch import build_step_inputs
from deepinfer.worker.request_states import StepChunk
from tests.models.tiny_models import TINY_IMAGE_TOKENS, TINY_VISION, build_tiny_vision_checkpoint

NEW_TOKENS = 12
BLOCK = 16
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
LAYOUT = ImageTokenLayout(TINY_IMAGE_TOKENS["boi_token_index"], TINY_IMAGE_TOKENS["eoi_token_index"],
                          TINY_IMAGE_TOKENS["image_token_index"], TINY_IMAGE_TOKENS["mm_tokens_per_image"])
NEWLINES = [10]   # the tiny vocabulary's stand-in for "\n\n"
BOI = LAYOUT.boi_token_id
# Prompts before expansion: each begin-of-image token stands for one image.
PROMPTS = {"one-image": [2, 5, 6, BOI, 7, 8, 9],
           "two-images": [2, 30, BOI, 31, 32, 33, BOI, 34, 35]}


def random_image(rng: np.random.Generator, width: int, height: int, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": None}[mode]
    shape = (height, width) if channels is None else (height, width, channels)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode)


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


# -- the image processor ---------------------------------------------------------------------------


def hf_pixel_values(images, **kwargs) -> torch.Tensor:
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(**kwargs)(images=images, return_tensors="pt")["pixel_values"]


def test_pixel_values_match_transformers():
    rng = np.random.default_rng(0)
    images = [random_image(rng, 17, 23), random_image(rng, 64, 48, "RGBA"), random_image(rng, 5, 40, "L"),
              random_image(rng, 32, 32), random_image(rng, 300, 200).convert("P")]
    transparent = random_image(rng, 40, 30).convert("P")
    transparent.info["transparency"] = 0   # a palette entry that is see-through: composited onto white
    images.append(transparent)
    for size in (32, 224):
        ours = ImageProcessor(ImageProcessorSettings(height=size, width=size)).preprocess(images)
        ref = hf_pixel_values(images, size={"height": size, "width": size})
        assert ours.dtype == torch.float32 and ours.shape == (len(images), 3, size, size)
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    # Other settings: a bicubic 40 x 24 resize, other mean and std, no rescale.
    settings = dict(resample=3, image_mean=[0.48, 0.45, 0.4], image_std=[0.26, 0.26, 0.27])
    ours = ImageProcessor(ImageProcessorSettings(height=40, width=24, **{k: tuple(v) if isinstance(v, list) else v
                                                                          for k, v in settings.items()},
                                                 do_rescale=False)).preprocess(images)
    ref = hf_pixel_values(images, size={"height": 40, "width": 24}, do_rescale=False, **settings)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_settings_come_from_preprocessor_config(tmp_path):
    from transformers import Gemma3ImageProcessorPil

    Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, resample=3,
                            image_mean=[0.1, 0.2, 0.3]).save_pretrained(str(tmp_path))
    processor = ImageProcessor.from_pretrained(str(tmp_path), {"vision_config": {"image_size": 32}})
    assert processor.settings == ImageProcessorSettings(height=896, width=896, resample=3,
                                                        image_mean=(0.1, 0.2, 0.3))
    # Without the file: the Gemma 3 defaults at the tower's size.
    processor = ImageProcessor.from_pretrained(str(tmp_path / "none"), {"vision_config": {"image_size": 32}})
    assert processor.settings == ImageProcessorSettings(height=32, width=32)
    with pytest.raises(ValueError, match="pan-and-scan"):
        ImageProcessorSettings.from_preprocessor_config({"do_pan_and_scan": True})


def test_decode_and_hash():
    rng = np.random.default_rng(1)
    image = random_image(rng, 20, 12)
    processor = ImageProcessor(ImageProcessorSettings(height=32, width=32))
    png, bmp = (processor.decode(encoded(image, fmt)) for fmt in ("PNG", "BMP"))
    assert png.mode == "RGB" and np.array_equal(np.asarray(png), np.asarray(image))
    # The same pixels in two files: one hash; other pixels or other settings: another.
    assert processor.image_hash(png) == processor.image_hash(bmp) == processor.image_hash(image)
    assert processor.image_hash(random_image(rng, 20, 12)) != processor.image_hash(png)
    other = ImageProcessor(ImageProcessorSettings(height=64, width=64))
    assert other.image_hash(png) != processor.image_hash(png)
    torch.testing.assert_close(processor([encoded(image, "PNG")]), processor.preprocess([image]), atol=0, rtol=0)


def test_bad_images_say_what_is_wrong():
    rng = np.random.default_rng(2)
    processor = ImageProcessor(max_pixels=1000)
    with pytest.raises(ValueError, match="not an image"):
        processor.decode(b"this is plain text, not a picture")
    with pytest.raises(ValueError, match="not an image: the data is empty"):
        processor.decode(b"")
    for fmt in ("PNG", "JPEG"):
        data = encoded(random_image(rng, 30, 30), fmt)
        with pytest.raises(ValueError, match=f"truncated or corrupt {fmt}"):
            processor.decode(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"image too large: 40x30 = 1200 pixels, over the limit of 1000 pixels"):
        processor.decode(encoded(random_image(rng, 40, 30), "PNG"))
    with pytest.raises(ValueError, match="must be bytes"):
        processor.decode("a string")


# -- the model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, our model loaded from its saved checkpoint, the checkpoint directory)."""
    directory = str(tmp_path_factory.mktemp("gemma3_vision"))
    hf = build_tiny_vision_checkpoint(directory)
    source = load_model_source(directory)
    assert model_class(source.hf_config) is Gemma3ForConditionalGeneration
    ours = Gemma3ForConditionalGeneration(source.hf_config).eval()
    ours.load_from(source)
    return hf, ours, directory


def test_vision_tower_and_projector_match_transformers(tiny):
    hf, ours, _ = tiny
    pixel_values = torch.randn(3, 3, TINY_VISION["image_size"], TINY_VISION["image_size"])
    with torch.no_grad():
        ref = hf.model.get_image_features(pixel_values, return_dict=True)
        torch.testing.assert_close(ours.vision_tower(pixel_values), ref.last_hidden_state, atol=1e-4, rtol=0)
        embeds = ours.encode_images(pixel_values)
    assert embeds.shape == (3, LAYOUT.tokens_per_image, hf.config.text_config.hidden_size)
    torch.testing.assert_close(embeds, ref.pooler_output, atol=1e-4, rtol=0)


def test_checkpoint_layouts_map_to_one_model(tiny):
    """transformers 5's in-memory names (model.language_model.*, model.vision_tower.*, lm_head), and
    the hub's (vision_tower.vision_model.*), load the same weights as the 5.x save did."""
    hf, ours, _ = tiny
    state = hf.state_dict()
    hub = {name.replace("model.vision_tower.", "vision_tower.vision_model.")
               .replace("model.language_model.", "language_model.model.")
               .replace("model.multi_modal_projector.", "multi_modal_projector."): t for name, t in state.items()}
    assert canonical_weight_name("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert canonical_weight_name("vision_tower.vision_model.post_layernorm.bias") == "vision_tower.post_layernorm.bias"
    assert canonical_weight_name("model.vision_tower.head.probe") is None
    expected = ours.state_dict()
    for names in (state, hub):
        other = Gemma3ForConditionalGeneration(ours.hf_config).eval()
        other.load_weights(names.items())
        for name, tensor in other.state_dict().items():
            assert torch.equal(tensor, expected[name]), name


def prompt_of(name: str) -> list[int]:
    return LAYOUT.expand(PROMPTS[name], NEWLINES)


def pixel_values_for(prompt: list[int], seed: int) -> torch.Tensor:
    """Real images through our processor (equal to transformers', tested above)."""
    rng = np.random.default_rng(seed)
    images = [random_image(rng, 24 + 9 * i, 40 - 5 * i) for i in range(len(LAYOUT.placeholders(prompt)))]
    size = TINY_VISION["image_size"]
    return ImageProcessor(ImageProcessorSettings(height=size, width=size)).preprocess(images)


def hf_inputs(prompt: list[int], pixel_values: torch.Tensor, bidirectional: bool = True) -> dict:
    ids = torch.tensor([prompt])
    inputs = dict(input_ids=ids, pixel_values=pixel_values, attention_mask=torch.ones_like(ids))
    if bidirectional:   # what Gemma3Processor returns: 1 at the image tokens
        inputs["token_type_ids"] = (ids == LAYOUT.image_token_id).long()
    return inputs


def hf_greedy(hf, prompt: list[int], pixel_values: torch.Tensor) -> list[int]:
    hf.generation_config.eos_token_id = None   # exactly NEW_TOKENS tokens
    out = hf.generate(**hf_inputs(prompt, pixel_values), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class ModelSteps:
    """One request through our model step by step, as the runner lays each step out
    (worker/input_batch.build_step_inputs, the reference attention backend), without a scheduler:
    the prompt in chunks of the given sizes, then one decode step a token."""

    def __init__(self, model: Gemma3ForConditionalGeneration, device: str, max_tokens: int,
                 backend: str = "reference", fresh_sdpa_min_tokens: int | None = None) -> None:
        self.model, self.device, self.backend = model, torch.device(device), backend
        self.fresh_sdpa_min_tokens = fresh_sdpa_min_tokens   # StepLayout's (the Triton backend's SDPA)
        self.layout = KVLayout.from_specs(model.kv_cache_specs(torch.float32), BLOCK, torch.float32)
        per_group = -(-max_tokens // BLOCK)
        # Block 0 is the null block; groups of one pool share its slots, so each gets its own ids.
        self.tables = [list(range(1 + g * per_group, 1 + (g + 1) * per_group)) for g in range(len(self.layout.groups))]
        self.caches = self.layout.allocate(1 + len(self.layout.groups) * per_group, self.device)

    def forward(self, tokens: list[int], start: int, num_tokens: int, images: StepImages | None,
                every_row: bool = False) -> torch.Tensor:
        chunk = StepChunk("r", start, num_tokens, self.tables, sample=True)
        inputs = build_step_inputs([chunk], {"r": tokens}, self.layout.groups, BLOCK, self.layout.layer_to_group,
                                   self.layout.layer_to_slot, self.caches, self.device, backend=self.backend,
                                   fresh_sdpa_min_tokens=self.fresh_sdpa_min_tokens)
        with torch.no_grad(), forward_context(inputs.attention):
            hidden = self.model(inputs.input_ids, inputs.positions, None, images=images)
            return self.model.compute_logits(hidden if every_row else hidden[-1:])

    def greedy(self, prompt: list[int], pixel_values: torch.Tensor, chunks: list[int] | None = None) -> list[int]:
        embeds = self.model.encode_images(pixel_values.to(self.device))   # the encoder stage, once
        places = self.model.image_layout.placeholders(prompt)
        tokens, start = list(prompt), 0
        for size in chunks or [len(prompt)]:
            images = StepImages.for_chunk(places, embeds, start, size)
            logits = self.forward(tokens, start, size, images)
            start += size
        assert start == len(prompt)
        out = []
        for _ in range(NEW_TOKENS):
            out.append(int(logits[0].argmax()))
            tokens.append(out[-1])
            logits = self.forward(tokens, len(tokens) - 1, 1, None)   # text only from here on
        return out


@pytest.mark.parametrize("device, backend", [("cpu", "reference"), ("cpu", "cpu"),
                                             pytest.param("cuda", "reference", marks=ON_CUDA)],
                         ids=["cpu-reference", "cpu-cpu", "cuda-reference"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_tokens_match_transformers(tiny, name, device, backend):
    hf, ours, _ = tiny
    prompt = prompt_of(name)
    pixel_values = pixel_values_for(prompt, seed=len(prompt))
    assert len(LAYOUT.placeholders(prompt)) == PROMPTS[name].count(BOI)
    reference = hf_greedy(hf, prompt, pixel_values)
    model = ours.to(device)
    try:
        steps = lambda: ModelSteps(model, device, len(prompt) + NEW_TOKENS, backend)
        assert steps().greedy(prompt, pixel_values) == reference
        # Chunked prefill, each image's tokens within one chunk (the scheduler's invariant).
        places = LAYOUT.placeholders(prompt)
        cut = places[0].offset - 1
        chunks = [cut, len(prompt) - cut] if len(places) == 1 else [cut, places[1].offset - cut,
                                                                    len(prompt) - places[1].offset]
        assert steps().greedy(prompt, pixel_values, chunks) == reference
    finally:
        ours.to("cpu")


def test_text_only_prompts_through_the_engine(tiny):
    """The registered model serves text-only prompts through the engine as well: greedy tokens
    equal transformers' for a prompt without images (test_gemma3_vision_engine.py has images)."""
    from deepinfer import LLM, SamplingParams

    hf, _, directory = tiny
    prompt = [2, 5, 6, 7, 8, 9, 40, 41]
    hf.generation_config.eos_token_id = None
    reference = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                            pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(directory, dtype="float32", num_kv_blocks=256)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference


def test_image_tokens_attend_both_ways(tiny):
    """Prompt logits of every row against transformers' forward with token_type_ids (two-way
    attention inside each image), which differ from its forward without them."""
    hf, ours, _ = tiny
    prompt = prompt_of("two-images")
    pixel_values = pixel_values_for(prompt, seed=5)
    with torch.no_grad():
        two_way = hf(**hf_inputs(prompt, pixel_values)).logits[0]
        causal = hf(**hf_inputs(prompt, pixel_values, bidirectional=False)).logits[0]
    steps = ModelSteps(ours, "cpu", len(prompt))
    images = StepImages.for_chunk(LAYOUT.placeholders(prompt), ours.encode_images(pixel_values), 0, len(prompt))
    logits = steps.forward(prompt, 0, len(prompt), images, every_row=True)
    torch.testing.assert_close(logits, two_way, atol=1e-4, rtol=0)
    assert (causal - two_way).abs().max() > 1e-2   # the test would see a causal-only model


def test_a_prefix_hit_inside_an_image(tiny):
    """A chunk that starts inside an image whose first tokens are cached from a forward that saw
    the whole image (a prefix hit on the same image): the rest of the image attends to the cached
    keys causally and to its own later tokens, and the logits are the whole prompt's."""
    _, ours, _ = tiny
    prompt = prompt_of("one-image")
    place = LAYOUT.placeholders(prompt)[0]
    embeds = ours.encode_images(pixel_values_for(prompt, seed=3))
    steps = ModelSteps(ours, "cpu", len(prompt))
    whole = steps.forward(prompt, 0, len(prompt), StepImages.for_chunk([place], embeds, 0, len(prompt)))
    cut = place.offset + 5   # the cache now holds the whole prompt's K/V; recompute from here
    tail = steps.forward(prompt, cut, len(prompt) - cut, StepImages.for_chunk([place], embeds, cut, len(prompt) - cut))
    torch.testing.assert_close(tail, whole, atol=1e-5, rtol=0)


def test_an_image_split_across_chunks_is_refused(tiny):
    _, ours, _ = tiny
    prompt = prompt_of("one-image")
    place = LAYOUT.placeholders(prompt)[0]
    embeds = ours.encode_images(pixel_values_for(prompt, seed=0))
    steps = ModelSteps(ours, "cpu", len(prompt))
    cut = place.offset + 5
    with pytest.raises(ValueError, match="split"):
        steps.forward(prompt, 0, cut, StepImages.for_chunk([place], embeds, 0, cut))


def test_prompt_expansion_and_placeholders():
    expanded = LAYOUT.expand([1, BOI, 2], newline_ids=[10])
    n = LAYOUT.tokens_per_image
    assert expanded == [1, 10, BOI] + [LAYOUT.image_token_id] * n + [LAYOUT.eoi_token_id, 10, 2]
    assert LAYOUT.placeholders(expanded) == [ImagePlaceholder(3, n)]
    assert LAYOUT.image_text("<boi>", "<img>", "<eoi>") == "\n\n<boi>" + "<img>" * n + "<eoi>\n\n"
    with pytest.raises(ValueError, match="already holds image tokens"):
        LAYOUT.expand(expanded)
    with pytest.raises(ValueError, match="a run of 3"):
        LAYOUT.placeholders([1] + [LAYOUT.image_token_id] * 3 + [2])
