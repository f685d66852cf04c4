"""E/P/D at the engine level, on the tiny random Gemma3ForConditionalGeneration: the encode
instance's service (the vision tower alone) writes encoder outputs to a dir:// store; an engine
configured with that store loads them instead of running its own vision tower (its counter stays
at 0) and gives the greedy tokens of an engine without a store. A damaged entry is refused,
counted, and that image encoded locally, with the same tokens."""

from __future__ import annotations

import types

import pytest
import torch

from deepinfer import LLM
from deepinfer.kv_cache.store.locations import open_store
from deepinfer.models.loader import load_model_source
from deepinfer.multimodal.config import MultiModalConfig
from deepinfer.multimodal.encode_server import ImageEncoderService
from tests.models.test_gemma3_vision_engine import GREEDY, chat_messages, checkpoint  # noqa: F401  (a fixture)

RETENTION = {"chat": 3600.0}


def _service(directory: str, url: str) -> ImageEncoderService:
    config = types.SimpleNamespace(multimodal=MultiModalConfig())
    return ImageEncoderService.for_source(config, load_model_source(directory), torch.float32, torch.device("cpu"),
                                          open_store(url, RETENTION))


@pytest.fixture(scope="module")
def cold_tokens(checkpoint):  # noqa: F811
    llm = LLM(checkpoint[1], dtype="float32", num_kv_blocks=256)
    out = {seeds: llm.chat(chat_messages(list(seeds)), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
           for seeds in ((11,), (12, 13))}
    llm.engine.shutdown()
    return out


def test_engine_loads_encoder_outputs_from_the_store(checkpoint, cold_tokens, tmp_path):  # noqa: F811
    url = f"dir://{tmp_path / 'store'}"
    service = _service(checkpoint[1], url)
    for seeds in cold_tokens:
        answer = service.encode_request("/v1/chat/completions", {"messages": chat_messages(list(seeds))})
        assert [a["status"] for a in answer] == ["written"] * len(seeds)
    assert service.num_encoded == 3
    again = service.encode_request("/v1/chat/completions", {"messages": chat_messages([11])})
    assert again[0]["status"] == "present" and service.num_encoded == 3   # not encoded twice

    llm = LLM(checkpoint[1], dtype="float32", num_kv_blocks=256, kv_store=url)
    try:
        for seeds, want in cold_tokens.items():
            out = llm.chat(chat_messages(list(seeds)), GREEDY, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == want
        images = llm.engine.executor.runner.images
        assert images.num_encoded == 0   # the vision tower never ran here
        counters = llm.engine.stats().encoder
        assert counters["store_loaded"] == 3 and counters["store_misses"] == 0 and counters["encoded"] == 0
    finally:
        llm.engine.shutdown()


def test_a_damaged_entry_is_encoded_locally(checkpoint, cold_tokens, tmp_path):  # noqa: F811
    url = f"dir://{tmp_path / 'store'}"
    service = _service(checkpoint[1], url)
    answer = service.encode_request("/v1/chat/completions", {"messages": chat_messages([12, 13])})
    key = service.store.key(answer[0]["hash"])
    data = bytearray(service.store.backend.get([key])[0])
    data[-1] ^= 0x55
    service.store.backend.put([(key, bytes(data), "chat")])

    llm = LLM(checkpoint[1], dtype="float32", num_kv_blocks=256, kv_store=url)
    try:
        out = llm.chat(chat_messages([12, 13]), GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == cold_tokens[(12, 13)]
        counters = llm.engine.stats().encoder
        assert counters["encoded"] == 1 and counters["store_loaded"] == 1
        assert counters["store_invalid_corrupt"] == 1
    finally:
        llm.engine.shutdown()
