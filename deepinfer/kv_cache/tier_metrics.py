"""What /metrics shows of the KV tier behind the connector (host memory or the persistent store),
gathered in the engine core from both sides of the connector and sent with EngineStats.

    tier            "host" (kv_offloading_size) or "store" (kv_store)
    entries, bytes  what the tier holds now: host, its index (a block an entry); store, the
                    backend's cheap view (an entry a run of blocks, kv_cache/store/runs.py; dir:
                    this instance's estimate; Redis: DBSIZE and used_memory)
    writes          entries written: host, saves completed; store, entries the writer put (not
                    counting those the store already had)
    dropped_saves   blocks not saved: host, no slot free; store, the store down (either side),
                    a write that failed, or a shutdown that came first (the worker's count)
    evictions       by cause: lru (capacity: the host tier's LRU, a dir store's kv_store_size,
                    Redis's maxmemory evictions) and retention (expired: a dir store's gc, Redis's
                    expired keys; Redis's figures are the server's, INFO stats)
    corrupt         entries found bad and dropped, by reason: size (a look-up saw the wrong byte
                    size), or the entry's (kv_cache/store/entry.py REASONS)
    load_latency    a load from queued (allocate_loads) to its blocks on the device, as the
                    scheduler sees it (so in steps): what a request waits in WAITING_FOR_KV
    store_latency   a save from queued to held by the tier: host, the copy completed; store,
                    staged on the host to written to the backend (the writer thread)

Hits and misses are the scheduler side's token counts (KVConnectorStats.queries and hits). The
latencies are per transfer (one request's blocks of one layer group, copied together); the
histograms keep per-bucket counts over LATENCY_BUCKETS (exported cumulative, Prometheus-style).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.types.tier_stats import KVConnectorStats, KVTierMetrics, LatencyHistogram

if TYPE_CHECKING:
    from deepinfer.kv_cache.store.persistent_worker import StoreWorkerStats


def tier_metrics(tier: str, stats: KVConnectorStats, load_latency: LatencyHistogram,
                 save_latency: LatencyHistogram, worker: StoreWorkerStats | None = None) -> KVTierMetrics:
    """One tier's figures from its scheduler side (`stats`, the latencies it measured) and, for the
    store, its worker side's counters."""
    out = KVTierMetrics(tier, load_latency=load_latency.copy())
    if worker is None:   # host memory: everything is on the scheduler side
        out.entries, out.bytes, out.writes = stats.stored_blocks, stats.stored_bytes, stats.saved_blocks
        out.dropped_saves = stats.dropped_saves
        out.evictions["lru"] = stats.evictions
        out.store_latency = save_latency.copy()
        return out
    out.entries, out.bytes = worker.counts.entries, worker.counts.bytes
    out.writes = worker.written_entries
    out.dropped_saves = stats.dropped_saves + worker.dropped_saves
    out.evictions = {"lru": worker.counts.evicted, "retention": worker.counts.expired}
    out.corrupt = {"size": stats.corrupt_entries, **worker.bad_entries}
    out.store_latency = worker.write_latency.copy()
    return out
