"""The persistent KV store through the whole engine: a prefix one LLM computed into a directory
or Redis is reused by a fresh LLM on the same store, with identical greedy tokens (a short one,
one entry; a long one of 37 blocks, two whole runs and a shorter one); a bad entry (bit flip,
truncation, deleted, foreign version, half-written) in the middle of the long prefix is detected,
the prefix before it still loads, and the request recomputes the rest, identically to a cold
run; Redis stopped mid-run only costs recomputation, and is used again once it is back. A failed
load sends its request back to the queue, looked up once more (Scheduler._apply_kv_transfers,
KVTierLink.may_retry)."""

from __future__ import annotations

import logging
import os
import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.admission import EngineFacts, child_requests, to_request
from deepinfer.kv_cache.store import entry as entry_format
from tests.redis_server import redis_server  # noqa: F401  (a fixture)

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PREFIX = [(5 * i + 3) % 500 + 2 for i in range(100)]            # 6 full blocks and 4 tokens: one run
FOLLOW_UP = PREFIX + [9, 10, 11]
# The long prefix, at blocks of 8 tokens (the tiny model's 512 positions hold it): 37 full blocks
# and 4 tokens, stored as runs [0, 16), [16, 32) and the shorter [32, 37).
LONG_BS = 8
LONG = [(7 * i + 5) % 500 + 2 for i in range(37 * LONG_BS + 4)]
LONG_FOLLOW_UP = LONG + [9, 10, 11]


def make(model: str, store: str, **kwargs) -> LLM:
    kwargs = {"num_kv_blocks": 64, **kwargs}
    return LLM(model, dtype="float32", max_model_len=256, kv_store=store, **kwargs)


def worker_of(llm: LLM):
    return llm.engine.executor.runner.kv_connector


def cold(model: str) -> list[int]:
    return LLM(model, dtype="float32", num_kv_blocks=64, max_model_len=256).generate(
        [FOLLOW_UP], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def compute_prefix(model: str, store: str) -> None:
    a = make(model, store)
    a.generate([PREFIX], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert worker_of(a).flush(10)
    assert worker_of(a).stats().written_blocks == 6
    a.engine.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return cold(tiny_llama)


def _reuse(model: str, store: str, expected: list[int]) -> LLM:
    compute_prefix(model, store)
    b = make(model, store)
    out = b.generate([FOLLOW_UP], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= len(PREFIX) - BS
    assert out.outputs[0].token_ids == expected
    tier = b.engine.stats().kv_tier
    assert tier["loaded_blocks"] == 6 and tier["failed_loads"] == 0
    return b


def test_a_fresh_instance_reuses_a_prefix_from_a_directory(tiny_llama, tmp_path, expected):
    _reuse(tiny_llama, f"dir://{tmp_path}", expected)


def test_a_fresh_instance_reuses_a_prefix_from_redis(tiny_llama, redis_server, expected):  # noqa: F811
    _reuse(tiny_llama, redis_server.url, expected)


def _entries(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "blocks")) for f in fs
                  if f.endswith(".kv"))


def make_long(model: str, store: str | None, **kwargs) -> LLM:
    kwargs = {"num_kv_blocks": 128, "block_size": LONG_BS, "max_model_len": 512, **kwargs}
    store_kwargs = {"kv_store": store} if store else {}
    return LLM(model, dtype="float32", **store_kwargs, **kwargs)


@pytest.fixture(scope="module")
def long_expected(tiny_llama):
    llm = make_long(tiny_llama, None)
    out = llm.generate([LONG_FOLLOW_UP], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.shutdown()
    return out


def compute_long(model: str, store: str) -> None:
    a = make_long(model, store)
    a.generate([LONG], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert worker_of(a).flush(10)
    stats = worker_of(a).stats()
    assert (stats.written_blocks, stats.written_entries) == (37, 3)
    a.engine.shutdown()


def run_key(llm: LLM, tokens: list[int], last_block: int) -> tuple[bytes, bytes]:
    """The key of the entry whose run ends at `last_block` (inclusive) of `tokens`' chain."""
    facts = EngineFacts(llm.model_id, llm.max_model_len, llm.eos_token_ids)
    request = to_request(child_requests("probe", tokens, GREEDY, facts)[0], LONG_BS)
    request.hash_root = llm.engine.kv_manager.hash_root
    (group_key, _), = llm.engine.kv_tier.connector._layouts.values()
    return group_key, request.block_hashes[last_block]


def run_path(llm: LLM, store_root: str, tokens: list[int], last_block: int) -> str:
    """The file of that entry in a dir:// store."""
    from deepinfer.kv_cache.store.dir import DirStore

    return DirStore(store_root, {"chat": 1.0}).path(run_key(llm, tokens, last_block))


@pytest.mark.parametrize("store", ["dir", "redis"])
def test_a_long_prefix_of_several_runs_is_reused_whole(tiny_llama, tmp_path, redis_server, long_expected,  # noqa: F811
                                                       store):
    url = f"dir://{tmp_path}" if store == "dir" else redis_server.url
    compute_long(tiny_llama, url)
    if store == "dir":
        assert sorted(os.path.getsize(p) - entry_format.HEADER_SIZE for p in _entries(str(tmp_path))) == \
            sorted(n * 4 * 2 * LONG_BS * 2 * 16 * 4 for n in (16, 16, 5))   # blocks x the tiny model's block bytes
    b = make_long(tiny_llama, url, kv_store_load_policy="always")
    checks = b.engine.kv_tier.connector.backend.checks
    out = b.generate([LONG_FOLLOW_UP], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == long_expected
    assert out.num_cached_tokens == 37 * LONG_BS
    tier = b.engine.stats().kv_tier
    assert tier["loaded_blocks"] == 37 and tier["failed_loads"] == 0
    # One existence check per run: [0, 16), [16, 32), then [32, 37) (the request may hit its 37 blocks).
    assert b.engine.kv_tier.connector.backend.checks - checks == 3
    b.engine.shutdown()


@pytest.mark.parametrize("fault", ["bit_flip", "truncate", "delete", "foreign_version", "half_written"])
def test_a_bad_entry_drops_its_run_and_the_prefix_before_it_still_loads(tiny_llama, tmp_path, long_expected, fault):
    store = f"dir://{tmp_path}"
    compute_long(tiny_llama, store)
    b = make_long(tiny_llama, store, kv_store_load_policy="always")
    victim = run_path(b, str(tmp_path), LONG_FOLLOW_UP, 31)   # the second run, [16, 32)
    assert victim in _entries(str(tmp_path))
    if fault == "bit_flip":
        data = bytearray(open(victim, "rb").read())
        data[len(data) // 2] ^= 0x01
        open(victim, "wb").write(bytes(data))
    elif fault == "truncate":
        os.truncate(victim, os.path.getsize(victim) // 2)
    elif fault == "delete":
        os.remove(victim)
    elif fault == "foreign_version":
        data = bytearray(open(victim, "rb").read())
        data[4:6] = (7).to_bytes(2, "little")
        open(victim, "wb").write(bytes(data))
    else:   # a writer died mid-write: its temp file is there, the entry is not
        data = open(victim, "rb").read()
        os.remove(victim)
        open(victim + ".tmp.4242.1.dead", "wb").write(data[:len(data) // 3])
    out = b.generate([LONG_FOLLOW_UP], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == long_expected
    # The first run came from the store either way; the damaged run and what follows were computed.
    assert out.num_cached_tokens == 16 * LONG_BS
    tier, store_stats = b.engine.stats().kv_tier, worker_of(b).stats()
    if fault in ("bit_flip", "foreign_version"):   # found by the load: it fails, the request looks up again
        assert tier["failed_loads"] > 0
        assert store_stats.bad_entries["corrupt" if fault == "bit_flip" else "version"] == 1
    elif fault == "truncate":                       # found by the look-up (its size)
        assert tier["corrupt_entries"] == 1 and tier["failed_loads"] == 0
    else:                                           # absent: the look-up stops before it, nothing fails
        assert tier["failed_loads"] == 0 and tier["corrupt_entries"] == 0
    # The bad entry was dropped; the recomputed run was saved again, whole.
    assert worker_of(b).flush(10)
    data = open(victim, "rb").read()
    header = entry_format.decode_header(data)
    assert header.num_blocks == 16 and entry_format.checksum(data[entry_format.HEADER_SIZE:]) == header.checksum
    assert b.engine.kv_manager.blocks_in_use() == {}
    b.engine.shutdown()


def test_redis_stopped_mid_run_costs_only_recomputation(tiny_llama, redis_server, expected, caplog):  # noqa: F811
    b = _reuse(tiny_llama, redis_server.url, expected)
    b.engine.kv_tier.connector.health.backoff_s = 0.2
    worker_of(b).health.backoff_s = 0.2
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="deepinfer.kv_cache.store"):
        for _ in range(3):   # serving goes on, each request past the back-off trying the store again
            assert b.engine.kv_manager.reset_prefix_cache()
            out = b.generate([FOLLOW_UP], GREEDY, use_tqdm=False)[0]
            assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == expected
            time.sleep(0.25)
    # The first request's blocks were seen in the store moments before (persistent.KNOWN_TTL_S),
    # so it is not looked up: its load meets the outage, fails, and the request recomputes; the
    # two after it look up (the failed load made its blocks unknown) and meet it there.
    tier = b.engine.stats().kv_tier
    assert tier["store_errors"] >= 2 and tier["failed_loads"] > 0
    # One warning for the outage from each side that met it (the scheduler's look-ups, the
    # worker's writes), however many calls failed.
    down = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert 1 <= len(down) <= 2 and len({r.getMessage() for r in down}) == len(down)
    caplog.clear()
    redis_server.start()                                                # empty: nothing persisted
    time.sleep(0.3)
    b.generate([PREFIX + [1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert worker_of(b).flush(10)
    assert b.engine.kv_manager.reset_prefix_cache()
    out = b.generate([FOLLOW_UP], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= len(PREFIX) - BS and out.outputs[0].token_ids == expected
    assert "is back" in caplog.text


def test_sliding_window_kv_never_reaches_the_store(tmp_path):
    from tests.models.tiny_models import build_tiny_checkpoint

    directory = str(tmp_path / "gemma3")
    build_tiny_checkpoint("gemma3", directory, sliding_window=16)
    llm = make(directory, f"dir://{tmp_path / 'store'}", num_kv_blocks=512)
    llm.generate([PREFIX], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert worker_of(llm).flush(10)
    layouts = llm.engine.kv_tier.connector._layouts
    full_groups = [g for g in llm.engine.kv_manager.groups if g.spec.persisted]
    assert sorted(layouts) == [g.group_id for g in full_groups]
    assert len(full_groups) < len(llm.engine.kv_manager.groups)   # the model has sliding-window groups
    names = _entries(str(tmp_path / "store"))
    assert len(names) == len(full_groups)   # the prompt's 6 blocks: one run a group
    assert {n.rsplit(".", 2)[1] for n in names} == {layouts[g.group_id][0].hex() for g in full_groups}


def test_the_cli_has_the_store_flags():
    import argparse

    from deepinfer.cli.flags import add_dataclass_flags, dataclass_values
    from deepinfer.config import CacheConfig

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, CacheConfig)
    args = parser.parse_args(["--kv-store", "redis://127.0.0.1:6379/0", "--kv-retention", "chat=1d,agent=2h",
                              "--kv-store-load-timeout-s", "2.5", "--kv-store-size", "100"])
    config = CacheConfig(**dataclass_values(CacheConfig, args))
    assert (config.kv_store, config.kv_retention, config.kv_store_load_timeout_s, config.kv_store_size) == (
        "redis://127.0.0.1:6379/0", "chat=1d,agent=2h", 2.5, 100.0)
