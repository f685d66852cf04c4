"""A prompt longer than the KV store's staging buffer, at every model the tests run (the tiny random
checkpoints with a persisted layer group, DeepSeek-V4's tiny shape, and SmolLM2): every full
block of its prefill is written to a `dir://` store, and a fresh engine finds and loads all of
them, through the smallest buffer (two runs of 16 blocks: saves and loads stream through it run
by run; before streaming, a save kept only the blocks the buffer's save half held, and a request
loaded at most half the buffer). The tiny models at blocks of 8 tokens, so that a prompt their
512 positions hold spans more blocks than the buffer; DeepSeek-V4's blocks are a multiple of its
compress rate, and its prompt fits the buffer: it checks the rest. (SmolLM2 stays at blocks of 16:
at 8, its greedy tokens after loading this prompt's 408-token prefix differ from the cold run's,
with entries of one block as well as of many, while the loaded blocks equal the stored bytes.)"""

from __future__ import annotations

import os
import sys

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.kv_cache.store.runs import CHUNK_BLOCKS

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TINY = ["llama", "qwen2", "qwen3", "gemma3"]


def _checkpoint(name: str, directory: str) -> tuple[str, dict, int, int]:
    """(model, LLM kwargs, prompt length, vocabulary) of a test model."""
    if name == "smollm2":
        from deepinfer.models.bundled import default_model_path

        return default_model_path(), {"max_model_len": 1024}, 410, 40000
    if name == "deepseek_v4":
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
        from test_deepseek_v4_engine import write_checkpoint

        os.makedirs(directory, exist_ok=True)
        write_checkpoint(directory, "r4_16", 0)
        return directory, {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 320,
                           "enforce_eager": True}, 200, 90
    from tests.models.tiny_models import build_tiny_checkpoint

    build_tiny_checkpoint(name, directory)
    return directory, {"dtype": "float32", "max_model_len": 512, "block_size": 8}, 404, 500


def _worker(llm: LLM):
    return llm.engine.executor.runner.kv_connector


@pytest.mark.parametrize("name", [*TINY, "deepseek_v4", "smollm2"])
def test_a_prompt_longer_than_the_staging_buffer_is_stored_and_found_whole(name, tmp_path):
    model, kwargs, length, vocab = _checkpoint(name, str(tmp_path / "model"))
    store = f"dir://{tmp_path / 'store'}"
    prompt = [(7 * i + 11) % (vocab - 5) + 5 for i in range(length)]
    # A buffer asked for one block is raised to two runs: 16 slots for saves, 16 for loads.
    a = LLM(model, kv_store=store, kv_store_buffer_size=1e-9, **kwargs)
    assert _worker(a).staging.num_slots == 2 * CHUNK_BLOCKS
    bs = a.engine.kv_manager.block_size
    cold = a.generate([prompt], ONE_TOKEN, use_tqdm=False)[0].outputs[0].token_ids
    assert _worker(a).flush(30)
    persisted = [g for g in a.engine.kv_manager.groups if g.spec.persisted]
    assert persisted, "a model whose KV no store keeps tests nothing here"
    full_blocks = length // bs
    if name != "deepseek_v4":
        assert full_blocks > CHUNK_BLOCKS   # longer than each half of the buffer
    stats = _worker(a).stats()
    assert (stats.written_blocks, stats.dropped_saves) == (full_blocks * len(persisted), 0)
    a.engine.shutdown()
    # A fresh engine, the same smallest buffer: the whole prefix is found and loaded run by run.
    b = LLM(model, kv_store=store, kv_store_buffer_size=1e-9, kv_store_load_policy="always", **kwargs)
    out = b.generate([prompt], ONE_TOKEN, use_tqdm=False)[0]
    tier = b.engine.stats().kv_tier
    assert tier["hits"] == full_blocks * bs
    assert tier["loaded_blocks"] == full_blocks * len(persisted) and tier["failed_loads"] == 0
    if len(persisted) == len(b.engine.kv_manager.groups):   # no sliding window: nothing is replayed
        assert out.num_cached_tokens == full_blocks * bs
        assert out.outputs[0].token_ids == cold
    b.engine.shutdown()
