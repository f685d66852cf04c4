"""Gemma 3 with images through the engine (issue 45 items 2 and 3), on the tiny random
Gemma3ForConditionalGeneration of tests/models/tiny_models.py with a chat tokenizer:

- LLM.chat (OpenAI image_url parts, data: URLs) and LLM.generate (vLLM's multi_modal_data) give
  transformers' greedy tokens (generate with token_type_ids) for prompts with 1 and 2 images,
  with the whole prompt in one step and with chunked prefill whose chunks meet image tokens;
- a second request with the same image hits the prefix cache across the image's blocks and
  gives the same tokens; a different image at the same place never shares those blocks;
- the encoder cache: an image reused across requests is encoded once;
- the encoder budget: a burst of images spreads over steps while a running decode goes on;
- an image never split across chunks, and a budget that cannot hold one image refused at start.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer import LLM, SamplingParams
from deepinfer.multimodal.image_processor import ImageProcessor, ImageProcessorSettings
from tests.models.tiny_models import (
    TINY_IMAGE_TOKENS,
    TINY_VISION,
    tiny_vision_chat_model,
)

NEW_TOKENS = 8
IMAGE_TOKEN = TINY_IMAGE_TOKENS["image_token_index"]
TOKENS_PER_IMAGE = TINY_IMAGE_TOKENS["mm_tokens_per_image"]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gemma3_vision_engine"))
    return tiny_vision_chat_model(directory), directory


def picture(seed: int, width: int = 30, height: int = 20) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def chat_messages(seeds: list[int], text: str = "w5 w6", tail: str = "") -> list[dict]:
    content = [{"type": "text", "text": text}]
    for i, seed in enumerate(seeds):
        content.append({"type": "image_url", "image_url": {"url": data_url(encoded(picture(seed)))}})
        content.append({"type": "text", "text": f"w{30 + i} w{40 + i}"})
    if tail:
        content.append({"type": "text", "text": tail})
    return [{"role": "user", "content": content}]


def hf_greedy(hf, prompt: list[int], images: list[Image.Image]) -> list[int]:
    size = TINY_VISION["image_size"]
    pixel_values = ImageProcessor(ImageProcessorSettings(height=size, width=size)).preprocess(images)
    ids = torch.tensor([prompt])
    out = hf.generate(input_ids=ids, pixel_values=pixel_values, attention_mask=torch.ones_like(ids),
                      token_type_ids=(ids == IMAGE_TOKEN).long(), max_new_tokens=NEW_TOKENS, do_sample=False,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


class StepRecorder:
    """Records each plan the scheduler makes (what the encoder was asked to do, and the chunks)."""

    def __init__(self, llm: LLM) -> None:
        self.plans = []
        scheduler = llm.engine.scheduler
        schedule = scheduler.schedule

        def recording(*args, **kwargs):
            plan = schedule(*args, **kwargs)
            self.plans.append(plan)
            return plan

        scheduler.schedule = recording


@pytest.fixture(scope="module")
def chunked_llm(checkpoint):
    """Chunks of at most 20 tokens: every image (16 tokens) meets a chunk boundary somewhere."""
    return LLM(checkpoint[1], dtype="float32", num_kv_blocks=256, max_num_batched_tokens=20, block_size=16)


@pytest.fixture(scope="module")
def whole_llm(checkpoint):
    """The whole prompt in one step, no prefix cache (so the encoder cache alone reuses images)."""
    return LLM(checkpoint[1], dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)


@pytest.mark.parametrize("seeds", [[1], [2, 3]], ids=["one-image", "two-images"])
def test_chat_matches_transformers_in_one_step_and_in_chunks(checkpoint, whole_llm, chunked_llm, seeds):
    hf, directory = checkpoint
    out = whole_llm.chat(chat_messages(seeds), GREEDY, use_tqdm=False)[0]
    prompt = out.prompt_token_ids
    assert prompt.count(IMAGE_TOKEN) == TOKENS_PER_IMAGE * len(seeds)
    reference = hf_greedy(hf, prompt, [picture(s) for s in seeds])
    assert out.outputs[0].token_ids == reference
    recorder = StepRecorder(chunked_llm)
    chunked = chunked_llm.chat(chat_messages(seeds), GREEDY, use_tqdm=False)[0]
    assert chunked.prompt_token_ids == prompt and chunked.outputs[0].token_ids == reference
    # The prompt took several steps, and no chunk ended inside an image.
    starts = [c.start for p in recorder.plans for c in p.chunks]
    offsets = [i for i in range(len(prompt)) if prompt[i] == IMAGE_TOKEN and prompt[i - 1] != IMAGE_TOKEN]
    assert len([s for s in starts if s < len(prompt)]) > 1
    assert not any(o < s < o + TOKENS_PER_IMAGE for s in starts for o in offsets)


def test_generate_with_multi_modal_data(checkpoint, chunked_llm):
    """vLLM's offline form: a prompt marking each image with the begin-of-image token."""
    hf, _ = checkpoint
    boi = TINY_IMAGE_TOKENS["boi_token_index"]
    images = [picture(7), picture(8)]
    out = chunked_llm.generate({"prompt_token_ids": [2, 30, boi, 31, 32, 33, boi, 34, 35],
                                "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids.count(IMAGE_TOKEN) == 2 * TOKENS_PER_IMAGE
    assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, images)


def test_prefix_cache_hits_on_the_same_image_never_on_another(checkpoint, chunked_llm):
    hf, _ = checkpoint
    llm = chunked_llm
    text = "w5 w6 w7 w8 w9 w12 w13 w14 w15 w16"   # a full text block before the image
    tail = " ".join(f"w{20 + i}" for i in range(30))   # and full blocks after it
    first = llm.chat(chat_messages([4], text, tail), GREEDY, use_tqdm=False)[0]
    prompt = first.prompt_token_ids
    image_end = max(i for i, t in enumerate(prompt) if t == IMAGE_TOKEN) + 1
    again = llm.chat(chat_messages([4], text, tail), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= image_end   # blocks across the image are shared
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(hf, prompt, [picture(4)])
    other = llm.chat(chat_messages([5], text, tail), GREEDY, use_tqdm=False)[0]
    assert other.prompt_token_ids == prompt   # the same ids: only the picture differs
    image_start = prompt.index(IMAGE_TOKEN)
    # The text block before the image is shared; no block holding an image token is.
    assert 0 < other.num_cached_tokens <= image_start
    assert other.outputs[0].token_ids == hf_greedy(hf, prompt, [picture(5)])


def test_encoder_cache_reuses_an_image_across_requests_and_turns(whole_llm):
    llm = whole_llm
    images = llm.engine.scheduler.images
    before = images.num_encoded
    first = llm.chat(chat_messages([6]), GREEDY, use_tqdm=False)[0]
    assert images.num_encoded == before + 1
    # The next turn carries the same image in its history: not encoded again.
    turn = chat_messages([6]) + [{"role": "assistant", "content": "w9"}, {"role": "user", "content": "w12"}]
    llm.chat(turn, GREEDY, use_tqdm=False)
    again = llm.chat(chat_messages([6]), GREEDY, use_tqdm=False)[0]
    assert images.num_encoded == before + 1 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_encoder_cache_size_0_turns_the_cache_off(checkpoint, whole_llm):
    """--encoder-cache-size 0: an image sent again is encoded again (no prefix cache either, so
    only the encoder cache could have saved it), with the same tokens as a cached run."""
    llm = LLM(checkpoint[1], dtype="float32", num_kv_blocks=256, enable_prefix_caching=False, encoder_cache_size=0)
    images = llm.engine.scheduler.images
    first = llm.chat(chat_messages([7]), GREEDY, use_tqdm=False)[0]
    again = llm.chat(chat_messages([7]), GREEDY, use_tqdm=False)[0]
    assert images.num_encoded == 2 and images.num_cache_hits == 0 and not images.cached
    assert llm.engine.executor.runner.images.num_encoded == 2
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert whole_llm.chat(chat_messages([7]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        first.outputs[0].token_ids
    # One request with the image twice still encodes it once: a step's chunks share its encoding.
    twice = llm.chat(chat_messages([7, 7]), GREEDY, use_tqdm=False)[0]
    assert images.num_encoded == 3 and len(twice.outputs[0].token_ids) == NEW_TOKENS
    llm.engine.shutdown()
    with pytest.raises(ValueError, match="encoder_cache_size must be an integer >= 0"):
        LLM(checkpoint[1], dtype="float32", num_kv_blocks=64, encoder_cache_size=-1)


def test_encoder_cache_size_0_stays_bounded_under_async_scheduling(checkpoint):
    """--encoder-cache-size 0 with the overlapped loop: a step's encodings are dropped by the next
    plan's free list. With max_tokens=1 a request finishes at its prefill and the next plan has no
    chunks and, under async scheduling, no finished ids yet: that plan must still reach the runner,
    or its free list is lost and the runner's cache grows by an image a request."""
    llm = LLM(checkpoint[1], dtype="float32", num_kv_blocks=256, enable_prefix_caching=False, encoder_cache_size=0,
              async_scheduling=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    runner = llm.engine.executor.runner.images
    for seed in range(6):   # one at a time: each request's prefill is a step of its own
        out = llm.chat(chat_messages([20 + seed]), one, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 1
    assert llm.engine.scheduler.images.num_encoded == 6 and not llm.engine.scheduler.images.cached
    assert len(runner.cache) <= 1   # at most the last step's image, its free list not planned yet
    llm.engine.shutdown()


def test_a_burst_of_images_spreads_over_steps_while_a_decode_goes_on(checkpoint):
    hf, directory = checkpoint
    llm = LLM(directory, dtype="float32", num_kv_blocks=256, max_num_encoder_input_tokens=TOKENS_PER_IMAGE,
              enable_prefix_caching=False)
    recorder = StepRecorder(llm)
    long_decode = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    decode_id = llm._add_request(None, [2, 5, 6, 7], long_decode, 0, None)
    for _ in range(3):   # the text request is decoding
        llm._step()
    burst = [llm._prepare(llm._chat_prompt(chat_messages([10 + i]), None, True, None, None), GREEDY)
             for i in range(3)]
    ids = [llm._add_request(text, tokens, sp, 0, None, images=images) for text, tokens, sp, images in burst]
    start = len(recorder.plans)
    outputs = {r.request_id: r for r in llm._run(ids + [decode_id], use_tqdm=False)}
    plans = recorder.plans[start:]
    encoded = [len(p.images.encode) if p.images else 0 for p in plans]
    assert sum(encoded) == 3 and max(encoded) == 1   # one image a step: the budget holds one
    image_steps = [p for p in plans if p.images and p.images.encode]
    assert all(any(c.request_id == decode_id for c in p.chunks) for p in image_steps)   # the decode went on
    for (_, tokens, _, _), request_id, seed in zip(burst, ids, range(10, 13)):
        assert outputs[request_id].outputs[0].token_ids == hf_greedy(hf, tokens, [picture(seed)])


def test_a_budget_that_cannot_hold_an_image_is_refused_at_start(checkpoint):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=8 is less than the 16 tokens of one image"):
        LLM(checkpoint[1], dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens=4"):
        LLM(checkpoint[1], dtype="float32", num_kv_blocks=256, max_num_encoder_input_tokens=4)


def test_user_text_cannot_spell_an_image_marker(chunked_llm):
    """Only an image part makes image tokens: text that spells the marker stays text."""
    boi = TINY_IMAGE_TOKENS["boi_token_index"]
    spelled = "w5 <start_of_image> w6 <image_soft_token>"
    out = chunked_llm.chat([{"role": "user", "content": spelled}], GREEDY, use_tqdm=False)[0]
    assert boi not in out.prompt_token_ids and IMAGE_TOKEN not in out.prompt_token_ids
    out = chunked_llm.chat(chat_messages([1], spelled), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids.count(boi) == 1 and out.prompt_token_ids.count(IMAGE_TOKEN) == TOKENS_PER_IMAGE


def test_offline_chat_refuses_bad_images_by_part(chunked_llm):
    from deepinfer.multimodal.config import MultiModalConfig
    from deepinfer.multimodal.media import MediaLoader

    bad = [{"role": "user", "content": [{"type": "text", "text": "w5"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\].content\[1\]: not an image"):
        chunked_llm.chat(bad, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="fetching image URLs is off on this server"):
        MediaLoader(MultiModalConfig()).load("https://example.com/cat.png")
