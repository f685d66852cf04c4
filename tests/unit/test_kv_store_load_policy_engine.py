"""kv_store_load_policy through the whole engine, on a directory store: an instance that measured
its store slower than computing recomputes a stored prefix (nothing loaded, the same tokens as a
cold run) and counts the declined blocks; `always` loads it; a real engine measures both costs;
the host tier and a decode instance never decline; a declined hit is probed, never loaded; the
field is validated and a flag."""

from __future__ import annotations

import argparse
import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.cli.flags import add_dataclass_flags, dataclass_values
from deepinfer.config import CacheConfig
from deepinfer.engine.kv_load_policy import KVLoadPolicy
from tests.unit.test_kv_store_engine import (
    BS,
    FOLLOW_UP,
    GREEDY,
    PREFIX,
    cold,
    compute_prefix,
    make,
    worker_of,
)
from tests.unit.test_kv_tier_engine import _request


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return cold(tiny_llama)


def slow_store(policy: KVLoadPolicy) -> None:
    """Injected measurements: a load took a minute a block, prefill costs a microsecond a token."""
    policy.load_started("earlier", 1, 0.0)
    policy.load_finished("earlier", True, 60.0)
    policy.prefill_s_per_token = 1e-6


def test_a_store_measured_slower_than_computing_is_not_loaded(tiny_llama, tmp_path, expected):
    store = f"dir://{tmp_path}"
    compute_prefix(tiny_llama, store)
    b = make(tiny_llama, store)
    slow_store(b.engine.kv_tier.load_policy)
    out = b.generate([FOLLOW_UP], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == expected
    tier = b.engine.stats().kv_tier
    assert tier["loaded_blocks"] == 0 and tier["hits"] == 0 and tier["declined_loads"] == 6
    assert b.engine.kv_tier.load_policy.declined == 1
    assert b.engine.kv_manager.blocks_in_use() == {}
    # A request the scheduler could not admit yet is asked about again: one decision, counted once.
    hashes = _request(b, FOLLOW_UP).block_hashes
    link = b.engine.kv_tier
    assert [link.lookup(hashes, 0, request_id="waiting") for _ in range(3)] == [0, 0, 0]
    assert link.load_policy.declined == 2


def test_a_declined_hit_is_probed_without_making_anyone_wait(tiny_llama, tmp_path, expected):
    """With a probe due (here every declined hit), the prefix is recomputed as declined, and its
    entries are read beside it into no device block: the policy gets a load sample, nothing is
    loaded, and the answer is a cold run's."""
    store = f"dir://{tmp_path}"
    compute_prefix(tiny_llama, store)
    b = make(tiny_llama, store)
    policy = b.engine.kv_tier.load_policy
    slow_store(policy)
    policy.explore_every = 1
    weight = policy._w
    out = b.generate([FOLLOW_UP], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == expected
    deadline = time.monotonic() + 10
    while b.engine.kv_tier.busy:   # the probe may end after the request: the engine still polls it
        assert time.monotonic() < deadline
        b.engine.step()
    assert policy.explored == 1 and policy.declined == 1 and policy._w > weight   # a load sample
    tier = b.engine.stats().kv_tier
    assert tier["loaded_blocks"] == 0 and tier["failed_loads"] == 0
    assert worker_of(b).stats().loaded_blocks == 0
    assert b.engine.kv_manager.blocks_in_use() == {}


def test_always_loads(tiny_llama, tmp_path, expected):
    store = f"dir://{tmp_path}"
    compute_prefix(tiny_llama, store)
    b = make(tiny_llama, store, kv_store_load_policy="always")
    assert b.engine.kv_tier.load_policy is None
    out = b.generate([FOLLOW_UP], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= len(PREFIX) - BS and out.outputs[0].token_ids == expected
    tier = b.engine.stats().kv_tier
    assert tier["loaded_blocks"] == 6 and tier["declined_loads"] == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_engine_measures_its_loads_and_prefill_steps(tiny_llama, tmp_path, async_scheduling):
    store = f"dir://{tmp_path}"
    compute_prefix(tiny_llama, store)
    b = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512, kv_store=store,
            async_scheduling=async_scheduling)
    policy = b.engine.kv_tier.load_policy
    b.generate([FOLLOW_UP], GREEDY, use_tqdm=False)               # a load, measured
    assert policy.loaded == 1 and policy.load_seconds(6) > 0
    long_prompt = [(3 * i + 7) % 500 + 2 for i in range(400)]    # a prefill step of >= 256 tokens
    b.generate([long_prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert policy.prefill_s_per_token is not None and policy.prefill_s_per_token > 0


def test_the_host_tier_and_a_decode_instance_always_load(tiny_llama, tmp_path):
    host = LLM(tiny_llama, dtype="float32", num_kv_blocks=24, max_model_len=256, kv_offloading_size=0.01)
    assert host.engine.kv_tier is not None and host.engine.kv_tier.load_policy is None
    decode = make(tiny_llama, f"dir://{tmp_path}", kv_role="decode")
    assert decode.engine.kv_tier.load_policy is None


def test_the_policy_is_validated_and_a_flag():
    with pytest.raises(ValueError, match="kv_store_load_policy"):
        CacheConfig(kv_store="dir:///tmp/x", kv_store_load_policy="never")
    assert CacheConfig().kv_store_load_policy == "auto"
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, CacheConfig, choices={"kv_store_load_policy": ("auto", "always")})
    args = parser.parse_args(["--kv-store-load-policy", "always"])
    assert CacheConfig(**dataclass_values(CacheConfig, args)).kv_store_load_policy == "always"
