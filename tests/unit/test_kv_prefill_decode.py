"""Prefill/decode disaggregation through a KV store (CacheConfig.kv_role), engines in this
process on a real dir:// store: a prefill instance answers only once its prompt's blocks are
written; a decode instance loads them (no recompute of the prefix), gives a colocated engine's
greedy tokens and writes nothing; a hand-over that is lost or damaged is recomputed to the same
tokens. (Through servers behind the router: tests/e2e/test_router_prefill_decode.py.)"""

from __future__ import annotations

import os

import pytest

from deepinfer import LLM, SamplingParams
from tests.unit.test_kv_store_engine import BS, FOLLOW_UP, GREEDY, PREFIX, make, worker_of

ONE = SamplingParams(temperature=0, max_tokens=1)


def _entries(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "blocks")) for f in fs
            if f.endswith(".kv")]


@pytest.fixture(scope="module")
def colocated(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=256)
    out = llm.generate([PREFIX, FOLLOW_UP], GREEDY, use_tqdm=False)
    llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in out]


def test_prefill_answers_once_written_and_decode_loads_it(tiny_llama, tmp_path, colocated):
    store = f"dir://{tmp_path}"
    prefill = make(tiny_llama, store, kv_role="prefill")
    prefill.generate([PREFIX], ONE, use_tqdm=False)
    # No flush: the answer itself waited for the writes (the prompt's 6 blocks: one run, written
    # when the request finished).
    assert len(_entries(str(tmp_path))) == 1
    decode = make(tiny_llama, store, kv_role="decode")
    out = decode.generate([PREFIX], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == colocated[0]
    assert out.num_cached_tokens == len(PREFIX) // BS * BS
    assert decode.engine.stats().kv_tier["loaded_blocks"] == len(PREFIX) // BS
    # The decode instance computed the follow-up's blocks but stores none of them.
    decode.generate([FOLLOW_UP], GREEDY, use_tqdm=False)
    assert worker_of(decode).flush(10) and worker_of(decode).stats().written_blocks == 0
    assert len(_entries(str(tmp_path))) == 1
    prefill.engine.shutdown()
    decode.engine.shutdown()


@pytest.mark.parametrize("fault", ["truncate", "delete"])
def test_a_lost_hand_over_is_recomputed(tiny_llama, tmp_path, colocated, fault):
    store = f"dir://{tmp_path}"
    prefill = make(tiny_llama, store, kv_role="prefill")
    prefill.generate([FOLLOW_UP], ONE, use_tqdm=False)
    (entry,) = _entries(str(tmp_path))   # the prompt's one run
    if fault == "truncate":
        os.truncate(entry, os.path.getsize(entry) // 2)
    else:
        os.remove(entry)
    decode = make(tiny_llama, store, kv_role="decode")
    out = decode.generate([FOLLOW_UP], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == colocated[1]
    assert out.num_cached_tokens < len(FOLLOW_UP) // BS * BS   # some of the prompt recomputed
    prefill.engine.shutdown()
    decode.engine.shutdown()


def test_a_role_needs_a_store(tiny_llama):
    with pytest.raises(ValueError, match="kv_role='prefill' hands KV over through a store: set kv_store"):
        LLM(tiny_llama, kv_role="prefill")
    with pytest.raises(ValueError, match="kv_role must be one of both, prefill, decode"):
        LLM(tiny_llama, kv_role="producer")
