"""`load_format="dummy"` for Gemma3ForConditionalGeneration: a config-only directory of the tiny
vision checkpoint (the GPU benchmark's way of serving Gemma-3-4B's shape without its weights,
benchmarks/vision_serving.py) builds the tower and projector with random weights from the seed,
so images embed to distinct, non-zero rows (a zero projection would make every image the same
to the language model), the same for every engine of one seed, and a chat with an image runs."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from deepinfer import LLM
from deepinfer.multimodal.image_processor import ImageProcessor, ImageProcessorSettings
from tests.models.test_gemma3_vision_engine import GREEDY, NEW_TOKENS, chat_messages, picture
from tests.models.tiny_models import TINY_VISION, tiny_vision_chat_model


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    full = str(tmp_path_factory.mktemp("vision_full"))
    tiny_vision_chat_model(full)
    shape = tmp_path_factory.mktemp("vision_shape")
    for name in os.listdir(full):
        if not name.endswith(".safetensors"):   # the shape, the tokenizer, no weights
            shutil.copy(os.path.join(full, name), shape / name)
    return str(shape)


def embeddings(llm: LLM, seeds: list[int]) -> torch.Tensor:
    size = TINY_VISION["image_size"]
    pixels = ImageProcessor(ImageProcessorSettings(height=size, width=size)).preprocess([picture(s) for s in seeds])
    with torch.no_grad():
        return llm.engine.executor.runner.model.encode_images(pixels)


def test_dummy_vision_model_embeds_images_apart(shape_dir):
    llm = LLM(shape_dir, load_format="dummy", dtype="float32", num_kv_blocks=256, seed=5)
    embeds = embeddings(llm, [1, 2])
    assert embeds.abs().sum() > 0 and not torch.allclose(embeds[0], embeds[1])
    out = llm.chat(chat_messages([1]), GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == NEW_TOKENS
    assert llm.engine.scheduler.images.num_encoded == 1
    llm.engine.shutdown()
    again = LLM(shape_dir, load_format="dummy", dtype="float32", num_kv_blocks=256, seed=5)
    np.testing.assert_array_equal(embeddings(again, [1, 2]).numpy(), embeds.numpy())
