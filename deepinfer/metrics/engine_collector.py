"""The engine core's EngineStats as Prometheus families, built when /metrics is scraped.

The core sends its scheduler gauges and its cumulative counters (prefix cache, preemptions,
speculative decoding) with every step and heartbeat. The front end keeps only the latest
EngineStats; this collector (prometheus_client's custom-collector pattern) turns it into
families at scrape time, so a cumulative total is exported as it is, never turned into
increments by hand.

A dead or silent engine core (the client's `healthy` is False) keeps `engine_healthy` at 0 and
drops the gauges that describe the engine's present (running, waiting, KV usage) from the scrape:
their last values would claim a busy engine, 0 would claim an idle one that a router or an
autoscaler may send traffic to, and NaN poisons sums over replicas. A series that disappears is
marked stale by Prometheus at the next scrape, so panels show a gap and `absent()` alerts fire.
The counters stay: they are history, and a counter that vanishes reads as a reset.

A restarted core counts from zero again; `engine_started()` folds the totals of the core that
is gone into a base, so every exported counter only ever goes up.

With data parallelism (N engine cores behind the server) each core's stats are kept apart and
every series carries its core's index in the `engine` label, as vLLM labels them; a dead core
drops its own gauges only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from deepinfer.types.plan import EngineStats
from deepinfer.types.tier_stats import KVTierMetrics

# vLLM labels every engine metric with the engine index: the core's data-parallel rank, 0..N-1.
LABELS = ["model_name", "engine"]

# The core's cumulative counters: name -> help. The per-position ones carry a `position` label,
# the per-group ones `group` and `kind` (and evictions a `cause`).
COUNTERS = {
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "num_preemptions": "Cumulative number of preemptions from the engine.",
    "spec_decode_num_drafts": "Verifications (a request's drafts checked once).",
    "spec_decode_num_draft_tokens": "Draft tokens verified.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
    "spec_decode_num_accepted_tokens_per_pos": "Draft tokens accepted, by position in the draft.",
    "spec_decode_num_verified_tokens_per_pos": "Draft tokens verified, by position in the draft.",
    "kv_cache_group_queries": "Prefix cache queries of one KV layer group, in tokens.",
    "kv_cache_group_hits": "Tokens whose KV one layer group took from its cache.",
    "kv_cache_group_replayed_tokens": "Tokens recomputed to rebuild a sliding-window group's KV "
                                      "(SWA Bounded Replay).",
    "kv_cache_group_evictions": "Cached blocks of one layer group dropped: cause=lru (the pool was "
                                "full) or retention (swa_retention_s ran out).",
    "kv_tier_queries": "Tokens looked up in the KV tier past the device's prefix hit.",
    "kv_tier_hits": "Of those, tokens the KV tier held (loaded instead of computed).",
    "kv_tier_misses": "Of those, tokens the KV tier did not hold (computed).",
    "kv_tier_loaded_blocks": "Blocks (of one layer group each) copied from the KV tier to the device.",
    "kv_tier_saved_blocks": "Blocks copied from the device to the KV tier.",
    "kv_tier_writes": "Entries written to the KV tier (a store: written to the backend, not counting "
                      "entries it already had).",
    "kv_tier_evictions": "KV tier entries dropped: cause=lru (capacity) or retention (expired; Redis: the "
                         "server's own counts).",
    "kv_tier_refused_saves": "Blocks offered to the KV tier of a kind it never holds (sliding window).",
    "kv_tier_dropped_saves": "Blocks not saved: every host tier slot was pinned, or the KV store was down, "
                             "refused the write or was shut down before it.",
    "kv_tier_failed_loads": "Blocks whose load from the KV store failed (bad entry, store down, timeout); recomputed.",
    "kv_tier_corrupt_entries": "KV store entries found damaged and dropped, by reason (size: seen by a look-up; "
                               "truncated, version, corrupt, mismatch: by a load).",
    "kv_tier_store_errors": "Calls to the KV store that failed (down, full, unreachable).",
    "kv_tier_declined_loads": "Blocks the KV store held that were recomputed instead, measured faster than "
                              "loading them (kv_store_load_policy=auto).",
    "encoder_cache_hits": "Images found in the encoder cache (memory): not encoded again.",
    "encoder_images_encoded": "Images run through the vision tower on this instance.",
    "encoder_encode_seconds": "Seconds spent running the vision tower and projector on this instance.",
    "encoder_store_loaded": "Encoder outputs loaded from the store (kv_store, E/P/D) instead of encoded.",
    "encoder_store_misses": "Encoder outputs looked up in the store and not found (or the store down); encoded here.",
    "encoder_store_invalid": "Encoder outputs in the store refused and dropped, by reason (size, truncated, version, "
                             "corrupt, mismatch); encoded here.",
    "encoder_store_errors": "Calls to the store for encoder outputs that failed (down, unreachable).",
}
# EngineStats.encoder's names -> (counter, labels); store_invalid_<reason> carries a reason label.
ENCODER_COUNTERS = {"cache_hits": "encoder_cache_hits", "encoded": "encoder_images_encoded",
                    "encode_seconds": "encoder_encode_seconds", "store_loaded": "encoder_store_loaded",
                    "store_misses": "encoder_store_misses", "store_errors": "encoder_store_errors"}
TIER = (("tier", "host"),)
# Families built from KVTierMetrics (kv_cache/tier_stats.py), not from the flat kv_tier counters.
_FROM_TIER_METRICS = ("kv_tier_evictions", "kv_tier_corrupt_entries", "kv_tier_dropped_saves")
LATENCY_HISTOGRAMS = {
    "load_latency": ("kv_tier_load_latency_seconds", "A KV tier load, from queued to its blocks on the device."),
    "store_latency": ("kv_tier_store_latency_seconds", "A KV tier save, from queued (a store: staged on the host) "
                                                       "to held by the tier."),
}
# Exported from the start (at 0), so that rate() has a series before the first request.
ALWAYS_EXPORTED = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")

# A counter's key: (name, its own labels as (label, value) pairs beyond model_name and engine).
CounterKey = tuple[str, tuple[tuple[str, str], ...]]


def engine_counters(stats: EngineStats) -> dict[CounterKey, float]:
    """The cumulative counters carried by one EngineStats."""
    # The request-level figures: tokens queried, and tokens not computed (a replayed token is
    # computed, so it is no hit).
    counters: dict[CounterKey, float] = {
        ("prefix_cache_queries", ()): stats.prefix_cache_request_queries,
        ("prefix_cache_hits", ()): stats.prefix_cache_request_hits,
        ("num_preemptions", ()): stats.num_preemptions,
    }
    for g, kind in enumerate(stats.kv_group_kinds):
        group = (("group", str(g)), ("kind", kind))
        counters[("kv_cache_group_queries", group)] = stats.prefix_cache_queries[g]
        counters[("kv_cache_group_hits", group)] = stats.prefix_cache_hits[g]
        counters[("kv_cache_group_replayed_tokens", group)] = stats.prefix_cache_replayed[g]
        counters[("kv_cache_group_evictions", group + (("cause", "lru"),))] = stats.prefix_cache_evictions[g]
        counters[("kv_cache_group_evictions", group + (("cause", "retention"),))] = stats.prefix_cache_expirations[g]
    tier_metrics = stats.kv_tier_metrics
    tier = (("tier", tier_metrics.tier),) if tier_metrics is not None else TIER
    for name, value in (stats.kv_tier or {}).items():
        if f"kv_tier_{name}" in COUNTERS and (tier_metrics is None or f"kv_tier_{name}" not in _FROM_TIER_METRICS):
            counters[(f"kv_tier_{name}", tier)] = value
    if tier_metrics is not None:
        flat = stats.kv_tier or {}
        counters[("kv_tier_misses", tier)] = flat.get("queries", 0) - flat.get("hits", 0)
        counters[("kv_tier_writes", tier)] = tier_metrics.writes
        counters[("kv_tier_dropped_saves", tier)] = tier_metrics.dropped_saves
        for cause, value in tier_metrics.evictions.items():
            counters[("kv_tier_evictions", tier + (("cause", cause),))] = value
        for reason, value in tier_metrics.corrupt.items():
            counters[("kv_tier_corrupt_entries", tier + (("reason", reason),))] = value
    for name, value in (stats.encoder or {}).items():
        if name in ENCODER_COUNTERS:
            counters[(ENCODER_COUNTERS[name], ())] = value
        elif name.startswith("store_invalid_"):
            counters[("encoder_store_invalid", (("reason", name.removeprefix("store_invalid_")),))] = value
    spec = stats.spec_decode
    if spec is not None:
        counters[("spec_decode_num_drafts", ())] = spec.num_drafts
        counters[("spec_decode_num_draft_tokens", ())] = spec.num_draft_tokens
        counters[("spec_decode_num_accepted_tokens", ())] = spec.num_accepted_tokens
        for j, (accepted, verified) in enumerate(zip(spec.accepted_per_pos, spec.verified_per_pos)):
            counters[("spec_decode_num_accepted_tokens_per_pos", (("position", str(j)),))] = accepted
            counters[("spec_decode_num_verified_tokens_per_pos", (("position", str(j)),))] = verified
    return counters


class EngineStatsCollector(Collector):
    """The latest EngineStats of each engine core (data-parallel rank `engine`), exported with the
    `engine` label; each family is yielded once, with a sample per core."""

    def __init__(self, prefix: str, model_name: str, healthy: Callable[[int], bool], num_engines: int = 1) -> None:
        self._prefix = prefix
        self._model_name = model_name
        self._healthy = healthy
        self._latest: list[EngineStats | None] = [None] * num_engines
        # Per core: the totals of its processes that are gone (restarts).
        self._retired: list[dict[CounterKey, float]] = [{} for _ in range(num_engines)]

    def update(self, stats: EngineStats, engine: int = 0) -> None:
        """Called with every EngineStats a core sends; only the latest is kept."""
        self._latest[engine] = stats

    def engine_started(self, engine: int = 0) -> None:
        """A (new) process of core `engine` is ready: what the previous one counted becomes the base."""
        latest, retired = self._latest[engine], self._retired[engine]
        if latest is not None:
            for key, value in engine_counters(latest).items():
                retired[key] = retired.get(key, 0) + value
        self._latest[engine] = None

    def collect(self) -> Iterator[Metric]:
        families = _Families(self._prefix, self._model_name)
        for engine in range(len(self._latest)):
            self._collect_engine(engine, families)
        yield from families.values()

    def _collect_engine(self, engine: int, out: _Families) -> None:
        healthy = self._healthy(engine)
        out.gauge("engine_healthy", "1 while the engine core process is alive and sending; 0 when it is dead or "
                  "silent (its gauges are then left out).", engine, 1.0 if healthy else 0.0)
        stats = self._latest[engine]
        if healthy and stats is not None:
            out.gauge("num_requests_running", "Number of requests in model execution batches.", engine,
                      stats.num_running)
            out.gauge("num_requests_waiting", "Number of requests waiting to be processed.", engine, stats.num_waiting)
            out.gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine,
                      stats.kv_cache_usage)
            # vLLM's name before 0.9, still what its Grafana dashboard reads.
            out.gauge("gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. "
                      "DEPRECATED: use kv_cache_usage_perc instead.", engine, stats.kv_cache_usage)
            tier_metrics = stats.kv_tier_metrics
            tier = (("tier", tier_metrics.tier),) if tier_metrics is not None else TIER
            if stats.kv_tier is not None and tier[0][1] == "host":   # a store's side sees no count: entries
                out.gauge("kv_tier_stored_blocks", "Blocks the KV tier holds (saves in flight included).", engine,
                          stats.kv_tier.get("stored_blocks", 0), tier)
            if tier_metrics is not None:
                out.gauge("kv_tier_entries", "Entries the KV tier holds (a dir store: this instance's estimate; "
                          "Redis: the keys of its database).", engine, tier_metrics.entries, tier)
                out.gauge("kv_tier_bytes", "Bytes the KV tier holds (Redis: the server's used memory).", engine,
                          tier_metrics.bytes, tier)
        self._counters(engine, out)
        if stats is not None and stats.kv_tier_metrics is not None:
            self._latencies(engine, stats.kv_tier_metrics, out)

    def _latencies(self, engine: int, tier_metrics: KVTierMetrics, out: _Families) -> None:
        # Not folded over engine restarts like the counters: a new core's histograms start at 0,
        # which Prometheus reads as a counter reset.
        for attribute, (name, documentation) in LATENCY_HISTOGRAMS.items():
            histogram = getattr(tier_metrics, attribute)
            family = out.family(HistogramMetricFamily, name, documentation, ["tier"])
            family.add_metric([self._model_name, str(engine), tier_metrics.tier], histogram.cumulative(),
                              histogram.total)

    def _counters(self, engine: int, out: _Families) -> None:
        totals = dict.fromkeys(((name, ()) for name in ALWAYS_EXPORTED), 0.0)
        for key, value in self._retired[engine].items():
            totals[key] = totals.get(key, 0) + value
        latest = self._latest[engine]
        if latest is not None:
            for key, value in engine_counters(latest).items():
                totals[key] = totals.get(key, 0) + value
        for (name, labels), value in totals.items():
            family = out.family(CounterMetricFamily, name, COUNTERS[name], [label for label, _ in labels])
            family.add_metric([self._model_name, str(engine)] + [v for _, v in labels], value)


class _Families(dict):
    """One scrape's families by name: each made once, on first use, and filled by every core, so
    the exposition has one family (one HELP and TYPE) per name with a sample per core."""

    def __init__(self, prefix: str, model_name: str) -> None:
        super().__init__()
        self._prefix, self._model_name = prefix, model_name

    def family(self, kind: type, name: str, documentation: str, labels: list[str]):
        family = self.get(name)
        if family is None:
            family = self[name] = kind(self._prefix + name, documentation, labels=LABELS + labels)
        return family

    def gauge(self, name: str, documentation: str, engine: int, value: float,
              labels: tuple[tuple[str, str], ...] = ()) -> None:
        family = self.family(GaugeMetricFamily, name, documentation, [k for k, _ in labels])
        family.add_metric([self._model_name, str(engine)] + [v for _, v in labels], value)
