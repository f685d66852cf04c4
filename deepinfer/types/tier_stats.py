"""The KV tier's counters and latency histograms: what both sides of the connector count and
what /metrics shows of a tier (kv_cache/tier_metrics.py gathers them; the module docstring there
says what each series means)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds: a host copy takes well under a millisecond, a Redis round trip about one, a shared
# mount or a loaded store up to seconds (and kv_store_load_timeout_s bounds a load).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
EVICTION_CAUSES = ("lru", "retention")


@dataclass
class LatencyHistogram:
    """Observations per bucket of LATENCY_BUCKETS (counts[-1]: above the largest), and their sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus buckets: (upper bound, observations at or below it), +Inf last."""
        out, running = [], 0
        for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), self.counts):
            running += n
            out.append((bound, float(running)))
        return out

    def copy(self) -> LatencyHistogram:
        return LatencyHistogram(list(self.counts), self.total)


@dataclass
class KVTierMetrics:
    tier: str
    entries: int = 0
    bytes: int = 0
    writes: int = 0
    dropped_saves: int = 0    # blocks not saved, by either side of the connector
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVICTION_CAUSES, 0))
    corrupt: dict[str, int] = field(default_factory=dict)
    load_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    store_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


@dataclass
class KVConnectorStats:
    """Cumulative counters of a tier (and one gauge), for /metrics."""

    queries: int = 0          # tokens looked up in the tier, beyond the device's prefix hit
    hits: int = 0             # of those, tokens the tier held
    loaded_blocks: int = 0    # blocks (of one group each) copied tier -> device
    saved_blocks: int = 0     # blocks copied device -> tier, counted once their save completed
    stored_blocks: int = 0    # gauge: entries held now, pending saves included
    stored_bytes: int = 0     # gauge: their bytes (host tier)
    evictions: int = 0        # entries dropped (LRU) to make room for a save
    refused_saves: int = 0    # blocks offered of a kind never persisted (sliding window)
    dropped_saves: int = 0    # blocks not saved: every slot was pinned by a load or pending (host),
                              # or the store is down (persistent)
    failed_loads: int = 0     # blocks whose load failed (the request recomputed them)
    corrupt_entries: int = 0  # entries found bad by a look-up (wrong size) and dropped
    store_errors: int = 0     # calls to a persistent store that failed (down, full)
    declined_loads: int = 0   # blocks a store held that were recomputed, faster than loading them
                              # (kv_store_load_policy=auto; counted by KVTierLink)

    def copy(self) -> KVConnectorStats:
        return KVConnectorStats(**vars(self))
