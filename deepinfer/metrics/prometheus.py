"""Prometheus export: vLLM v1's metrics, names and semantics, under our `deepinfer:` prefix.

    metrics = ServerMetrics(model_name, max_model_len, num_engines=N,
                            engine_healthy=lambda engine: client.engines[engine].healthy)
    metrics.engine_started(cache_config, num_gpu_blocks, pid, engine=i)   # each time core i is ready
    metrics.record_engine_stats(stats, iteration_tokens, engine=i)        # every message from core i
    metrics.record_first_output / record_tokens / record_finished(..., engine=i)   # per request, in
                                                                          # the front end, by its core
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics.http)
    metrics.render()                                            # the body of GET /metrics

Where the series come from:
    engine_collector.py   the core's gauges and cumulative counters (EngineStats), engine_healthy
    this file             per-request histograms and token counters, observed by the front end;
                          iteration_tokens_total from the core's per-step counts; cache_config_info
    http.py               http_* (prometheus-fastapi-instrumentator's names, as vLLM exports them)
    prometheus_client     process_* and python_* of this process; each engine core process's
                          resources as deepinfer_engine_core_process_* (with its `engine` label)

Every deepinfer: series carries `engine`, the index of the engine core (data-parallel rank) it
describes, as vLLM labels its series; the per-request ones are observed under the core the request
ran on. With one core it is always "0".

Suffixes, buckets and what is observed when are vLLM v1's, including the older names its Grafana
dashboard still reads (time_per_output_token_seconds, gpu_cache_usage_perc), so dashboards,
autoscalers and routers built for `vllm:*` work with a prefix change. `vllm_names=True`
(`--metrics-vllm-names`) also exports every `deepinfer:` family under `vllm:`, for tools that
cannot be told a prefix. It is off by default: every series would be stored twice, and a fleet
query over `vllm:*` would count these replicas as vLLM ones; Prometheus can also rename at scrape
time (metric_relabel_configs).

One difference: for a request of n > 1, vLLM counts each of its n sequences as a request of its
own in request_success, prompt_tokens_total, TTFT and the per-request histograms; we count the
request once (request_params_n and request_max_num_generation_tokens are once per request in
both, and iteration_tokens_total counts each sequence's prompt in both). For n = 1 they agree.

`*_created` series are switched off (prometheus_client's disable_created_metrics): one more
series per counter and histogram that dashboards never read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from deepinfer.config import CacheConfig
from deepinfer.metrics.engine_collector import LABELS, EngineStatsCollector
from deepinfer.metrics.http import HTTPMetrics
from deepinfer.metrics.stats import RequestTimings
from deepinfer.types.plan import EngineStats

PREFIX = "deepinfer:"
VLLM_PREFIX = "vllm:"

# vLLM v1's buckets, so histograms from both engines can be compared bucket by bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
# vLLM's label names where it has the field (it calls the KV pool's blocks num_gpu_blocks on every
# device), ours otherwise; values written as vLLM writes them, str(value).
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                       "num_gpu_blocks", "num_gpu_blocks_override", "cpu_kv_cache_bytes", "engine")


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts per request."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, *, num_engines: int = 1,
                 engine_healthy: Callable[[int], bool] = lambda engine: True, vllm_names: bool = False) -> None:
        disable_created_metrics()   # process-wide in prometheus_client; see the module docstring
        self.model_name = model_name
        # `own` holds the deepinfer: families; `registry` is what /metrics exposes: those (and
        # their vllm: copies), the HTTP metrics and the process collectors.
        own = CollectorRegistry()
        self.registry = CollectorRegistry()
        self.registry.register(_Aliased(own, PREFIX, VLLM_PREFIX if vllm_names else None))
        self.engine = EngineStatsCollector(PREFIX, model_name, engine_healthy, num_engines)
        own.register(self.engine)
        engines = [str(i) for i in range(num_engines)]

        # Each per-request series is a list with one labelled child per engine core, indexed by it.
        def counter(name: str, doc: str) -> list[Counter]:
            family = Counter(PREFIX + name, doc, LABELS, registry=own)
            return [family.labels(model_name, engine) for engine in engines]

        def histogram(name: str, doc: str, buckets) -> list[Histogram]:
            family = Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=own)
            return [family.labels(model_name, engine) for engine in engines]

        token_buckets = buckets_1_2_5(max_model_len)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                          LABELS + ["finished_reason"], registry=own)
        # Every reason from the start, so that increase() sees the first request of each.
        self._request_success = [{reason: success.labels(model_name, engine, reason) for reason in FINISH_REASONS}
                                 for engine in engines]
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TPOT_BUCKETS)
        # vLLM's name of the same histogram before 0.11, still what its Grafana dashboard reads.
        self.tpot_old_name = histogram("time_per_output_token_seconds", "Histogram of time per output token in "
                                       "seconds. DEPRECATED: use inter_token_latency_seconds instead.", TPOT_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets)
        self.request_params_n = histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.request_params_max_tokens = histogram("request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", token_buckets)
        # An info-style gauge (always 1, the cache config in its labels), set when a core is ready.
        self._cache_config_info = Gauge(PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                        CACHE_CONFIG_LABELS, registry=own)
        self._cache_config_labels: list[dict[str, str] | None] = [None] * num_engines

        self.http = HTTPMetrics(self.registry)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        # Each engine core's CPU and memory (its own process); no /proc entry, no series, until it runs.
        self._core_pids: list[int | None] = [None] * num_engines
        self.registry.register(_CoreProcesses(self._core_pids))

    # --------------------------------------------------------------------------- the engine core
    def engine_started(self, cache: CacheConfig, num_gpu_blocks: int, pid: int | None = None, engine: int = 0) -> None:
        """Core `engine` is ready (again, after a restart): its cache config, its pid, and the end
        of its previous process's counting."""
        self.engine.engine_started(engine)
        self._core_pids[engine] = pid
        old = self._cache_config_labels[engine]
        if old is not None:   # a restarted core may have sized its KV pool differently
            self._cache_config_info.remove(*(old[name] for name in CACHE_CONFIG_LABELS))
        labels = self._cache_config_labels[engine] = _cache_config_labels(cache, num_gpu_blocks, engine)
        self._cache_config_info.labels(**labels).set(1)

    def record_engine_stats(self, stats: EngineStats, iteration_tokens: Sequence[int] = (), engine: int = 0) -> None:
        """Every message from core `engine`: its latest stats, and the tokens of each engine step it
        carries (vLLM's iteration_tokens_total: one observation per step that produced output)."""
        self.engine.update(stats, engine)
        for tokens in iteration_tokens:
            self.iteration_tokens[engine].observe(tokens)

    # ------------------------------------------------------------------------------ per request
    # `engine`: the core the request runs on.
    def record_first_output(self, timings: RequestTimings, engine: int = 0) -> None:
        self.prompt_tokens[engine].inc(timings.num_prompt_tokens)
        if timings.ttft is not None:
            self.ttft[engine].observe(timings.ttft)

    def record_tokens(self, num_new: int, itl: float | None, engine: int = 0) -> None:
        self.generation_tokens[engine].inc(num_new)
        if itl is not None:
            self.itl[engine].observe(itl)
            self.tpot_old_name[engine].observe(itl)

    def record_finished(self, timings: RequestTimings, finish_reason: str, engine: int = 0) -> None:
        self._request_success[engine][finish_reason].inc()
        self.e2e[engine].observe(timings.e2e)
        self.request_prompt_tokens[engine].observe(timings.num_prompt_tokens)
        self.request_generation_tokens[engine].observe(timings.num_generation_tokens)
        # vLLM observes these once the last of the request's n sequences has finished.
        self.request_max_generation_tokens[engine].observe(timings.max_sequence_tokens)
        self.request_params_n[engine].observe(timings.n)
        if timings.max_tokens:
            self.request_params_max_tokens[engine].observe(timings.max_tokens)
        for histogram, value in ((self.queue_time, timings.queue_time), (self.prefill_time, timings.prefill_time),
                                 (self.decode_time, timings.decode_time),
                                 (self.inference_time, timings.inference_time),
                                 (self.request_tpot, timings.mean_time_per_output_token)):
            if value is not None:   # None: the core never reported this request's times (aborted here)
                histogram[engine].observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _cache_config_labels(cache: CacheConfig, num_gpu_blocks: int, engine: int) -> dict[str, str]:
    values = (cache.block_size, cache.kv_cache_dtype, cache.enable_prefix_caching, cache.gpu_memory_utilization,
              num_gpu_blocks, cache.num_kv_blocks, cache.cpu_kv_cache_bytes, engine)
    return dict(zip(CACHE_CONFIG_LABELS, map(str, values)))


class _CoreProcesses(Collector):
    """deepinfer_engine_core_process_*: prometheus_client's process metrics of each engine core
    process, read from its /proc entry, merged into one family per name with the core's index in
    an `engine` label (one collector per core would repeat each family's HELP and TYPE)."""

    def __init__(self, pids: list[int | None]) -> None:
        self._collectors = [ProcessCollector(namespace="deepinfer_engine_core",
                                             pid=lambda i=i: pids[i] or "no-engine-core", registry=None)
                            for i in range(len(pids))]

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for engine, collector in enumerate(self._collectors):
            for family in collector.collect():
                samples = [s._replace(labels={**s.labels, "engine": str(engine)}) for s in family.samples]
                if family.name in merged:
                    merged[family.name].samples += samples
                else:
                    merged[family.name] = copy.copy(family)
                    merged[family.name].samples = samples
        yield from merged.values()


class _Aliased(Collector):
    """Every family of `source`, and, with an alias, each one again with `prefix` swapped for it.

    The copies are made at scrape time from the same collected families, so both names always
    show the same numbers and no metric is defined twice."""

    def __init__(self, source: CollectorRegistry, prefix: str, alias: str | None) -> None:
        self._source, self._prefix, self._alias = source, prefix, alias

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            yield family
            if self._alias is not None:
                yield self._renamed(family)

    def _renamed(self, family: Metric) -> Metric:
        cut = len(self._prefix)
        renamed = copy.copy(family)
        renamed.name = self._alias + family.name[cut:]
        renamed.samples = [s._replace(name=self._alias + s.name[cut:]) for s in family.samples]
        return renamed
