"""The kv_tier_* series of /metrics (kv_cache/tier_stats.py, metrics/engine_collector.py) from real
engines: the host tier (entries, bytes, writes, LRU evictions, load and store latencies) and a
directory store (entries and bytes from the backend, writes by the writer thread, capacity
evictions, a corrupt entry by its reason), each under its `tier` label, through the msgpack
boundary the server's core process sends them over."""

from __future__ import annotations

import os
import time

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from deepinfer import LLM, SamplingParams
from deepinfer.engine.core_proc import OutputMessage, StepOutputs
from deepinfer.metrics.prometheus import ServerMetrics

PREFIX = [(5 * i + 3) % 500 + 2 for i in range(100)]            # 6 full blocks and 4 tokens
FILLERS = [[(7 * i + 11 * k) % 500 + 2 for i in range(100)] for k in range(1, 6)]
ONE = SamplingParams(temperature=0, max_tokens=1)
BLOCK_BYTES = 4 * 2 * 16 * 2 * 16 * 4   # the tiny Llama's block: 4 layers, K and V, 16 tokens x 2 heads x 16, fp32


def scrape(llm: LLM) -> dict[tuple[str, tuple], float]:
    """{(sample, sorted labels without model_name/engine): value}, the stats taken through msgpack."""
    step = StepOutputs([], llm.engine.stats(), {})
    stats = msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=OutputMessage).stats
    assert stats == step.stats
    metrics = ServerMetrics("m", 256)
    metrics.record_engine_stats(stats)
    return {(s.name.removeprefix("deepinfer:"),
             tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples
            if "kv_tier" in s.name}


def v(got: dict, name: str, tier: str, **labels: str) -> float:
    return got[(name, tuple(sorted({"tier": tier, **labels}.items())))]


def test_host_tier_series(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=24, max_model_len=256, kv_offloading_size=0.01)
    llm.generate([PREFIX], ONE, use_tqdm=False)
    for filler in FILLERS:   # evict the prefix from the device: the follow-up loads it from the host tier
        llm.generate([filler], ONE, use_tqdm=False)
    assert llm.generate([PREFIX + [9]], ONE, use_tqdm=False)[0].num_cached_tokens == 96
    got = scrape(llm)
    entries = v(got, "kv_tier_entries", "host")
    assert entries == v(got, "kv_tier_stored_blocks", "host") >= 6 * 6
    assert v(got, "kv_tier_bytes", "host") == entries * BLOCK_BYTES
    assert v(got, "kv_tier_writes_total", "host") == v(got, "kv_tier_saved_blocks_total", "host") == entries
    assert v(got, "kv_tier_hits_total", "host") == 96
    assert v(got, "kv_tier_misses_total", "host") == v(got, "kv_tier_queries_total", "host") - 96
    assert v(got, "kv_tier_evictions_total", "host", cause="lru") == 0
    assert v(got, "kv_tier_load_latency_seconds_count", "host") == 1
    assert v(got, "kv_tier_load_latency_seconds_bucket", "host", le="+Inf") == 1
    assert v(got, "kv_tier_store_latency_seconds_count", "host") >= 6
    # A tier of 8 blocks: the fillers' saves push older entries out, least recently used first.
    small = LLM(tiny_llama, dtype="float32", num_kv_blocks=24, max_model_len=256,
                kv_offloading_size=8 * BLOCK_BYTES / 2**30)
    for prompt in [PREFIX, *FILLERS[:2]]:
        small.generate([prompt], ONE, use_tqdm=False)
    got = scrape(small)
    assert v(got, "kv_tier_entries", "host") == 8 and v(got, "kv_tier_evictions_total", "host", cause="lru") == 10


def _store_counts(llm: LLM, entries: int, evicted: int = 0, timeout_s: float = 10.0) -> None:
    """Wait for the writer thread's next refresh of the backend's counts (every COUNTS_INTERVAL_S)."""
    worker = llm.engine.executor.runner.kv_connector
    deadline = time.monotonic() + timeout_s
    while (worker.stats().counts.entries, worker.stats().counts.evicted) != (entries, evicted):
        assert time.monotonic() < deadline, f"counts stayed at {worker.stats().counts}"
        time.sleep(0.1)


def test_store_tier_series(tiny_llama, tmp_path):
    from deepinfer.kv_cache.store.entry import HEADER_SIZE

    # Room for 14 blocks: the prefix is one entry (a run of 6 blocks), then a run of 12 pushes it out.
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=256, kv_store=f"dir://{tmp_path / 'a'}",
              kv_store_size=14 * BLOCK_BYTES / 2**30)
    worker = llm.engine.executor.runner.kv_connector
    llm.generate([PREFIX], ONE, use_tqdm=False)
    assert worker.flush(10)
    _store_counts(llm, 1)
    got = scrape(llm)
    assert v(got, "kv_tier_entries", "store") == 1 and v(got, "kv_tier_bytes", "store") == HEADER_SIZE + 6 * BLOCK_BYTES
    assert v(got, "kv_tier_writes_total", "store") == 1 and v(got, "kv_tier_store_latency_seconds_count", "store") == 1
    assert ("kv_tier_stored_blocks", (("tier", "store"),)) not in got   # the host tier's gauge; a store has entries
    llm.generate([[9] * 200], ONE, use_tqdm=False)      # 12 more blocks: past kv_store_size, the oldest go
    assert worker.flush(10)
    _store_counts(llm, 1, evicted=1)                    # down to 90 % of the limit: the run of 12 stays
    got = scrape(llm)
    assert v(got, "kv_tier_evictions_total", "store", cause="lru") == 1
    assert v(got, "kv_tier_evictions_total", "store", cause="retention") == 0
    llm.engine.shutdown()

    # A fresh instance loads a prefix from a store where one entry has a flipped bit: its load
    # fails (the request recomputes), and the entry is counted under its reason.
    writer = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=256, kv_store=f"dir://{tmp_path / 'b'}")
    writer.generate([PREFIX], ONE, use_tqdm=False)
    assert writer.engine.executor.runner.kv_connector.flush(10)
    writer.engine.shutdown()
    reader = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=256, kv_store=f"dir://{tmp_path / 'b'}")
    names = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "b" / "blocks") for f in fs
                   if f.endswith(".kv"))
    data = bytearray(open(names[0], "rb").read())
    data[-5] ^= 0x01
    open(names[0], "wb").write(bytes(data))
    reader.generate([PREFIX + [9]], ONE, use_tqdm=False)
    got = scrape(reader)
    assert v(got, "kv_tier_corrupt_entries_total", "store", reason="corrupt") == 1
    assert v(got, "kv_tier_corrupt_entries_total", "store", reason="size") == 0
    assert v(got, "kv_tier_failed_loads_total", "store") > 0
    reader.engine.shutdown()
