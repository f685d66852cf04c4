"""Prometheus export: vLLM's metric names under a `deepinfer:` prefix, one `model_name` label.

The suffixes match vLLM v1's exactly, so dashboards, autoscalers and KV-aware routers built for
`vllm:*` work with a prefix change. Gauges and cumulative counters come from the engine core's
EngineStats (sent with every step and heartbeat); latency histograms come from the front end's
RequestTimings (metrics/stats.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deepinfer.engine.core import EngineStats
from deepinfer.metrics.stats import RequestTimings
from deepinfer.spec_decode.metrics import SpecDecodeStats

PREFIX = "deepinfer:"

# vLLM's buckets (seconds), so histograms from both engines can be compared bucket by bucket.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def counter(name, doc, extra=()):
            metric = Counter(PREFIX + name, doc, labels + list(extra), registry=reg)
            return metric if extra else metric.labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.model_name = model_name
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Preemptions (KV blocks taken back) in the core.")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._request_success = counter("request_success", "Finished requests.", extra=["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.",
                                    _REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      _REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.", _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length per request.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Output length per request.",
                                                   _TOKEN_BUCKETS)
        # Speculative decoding (vLLM's spec_decode_* names); per position: accepted drafts at
        # position j, so acceptance at j = num_accepted_tokens_per_pos{position=j} / num_drafts.
        self.spec_num_drafts = counter("spec_decode_num_drafts", "Verifications (a request's drafts checked once).")
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft.", extra=["position"])
        self.spec_verified_per_pos = counter("spec_decode_num_verified_tokens_per_pos",
                                             "Draft tokens verified, by position in the draft.", extra=["position"])
        # The core's counters are cumulative; Prometheus counters only go up by increments.
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self._last_spec = SpecDecodeStats()

    # --------------------------------------------------------------------------- recording
    def record_engine_stats(self, stats: EngineStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        # A hit must be valid in every layer group, so the first group's counts are the request's.
        queries = stats.prefix_cache_queries[0] if stats.prefix_cache_queries else 0
        hits = stats.prefix_cache_hits[0] if stats.prefix_cache_hits else 0
        self._last_queries = _advance(self.prefix_cache_queries, self._last_queries, queries)
        self._last_hits = _advance(self.prefix_cache_hits, self._last_hits, hits)
        self._last_preemptions = _advance(self.num_preemptions, self._last_preemptions, stats.num_preemptions)
        if stats.spec_decode is not None:
            self._record_spec(stats.spec_decode)

    def _record_spec(self, spec: SpecDecodeStats) -> None:
        last = self._last_spec
        _advance(self.spec_num_drafts, last.num_drafts, spec.num_drafts)
        _advance(self.spec_num_draft_tokens, last.num_draft_tokens, spec.num_draft_tokens)
        _advance(self.spec_num_accepted_tokens, last.num_accepted_tokens, spec.num_accepted_tokens)
        for j, (accepted, verified) in enumerate(zip(spec.accepted_per_pos, spec.verified_per_pos)):
            prev_a = last.accepted_per_pos[j] if j < len(last.accepted_per_pos) else 0
            prev_v = last.verified_per_pos[j] if j < len(last.verified_per_pos) else 0
            _advance(self.spec_accepted_per_pos.labels(self.model_name, str(j)), prev_a, accepted)
            _advance(self.spec_verified_per_pos.labels(self.model_name, str(j)), prev_v, verified)
        self._last_spec = spec.copy()

    def record_first_output(self, timings: RequestTimings) -> None:
        self.prompt_tokens.inc(timings.num_prompt_tokens)
        if timings.ttft is not None:
            self.ttft.observe(timings.ttft)

    def record_tokens(self, num_new: int, itl: float | None) -> None:
        self.generation_tokens.inc(num_new)
        if itl is not None:
            self.itl.observe(itl)

    def record_finished(self, timings: RequestTimings, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, finish_reason).inc()
        self.e2e.observe(timings.e2e)
        self.request_prompt_tokens.observe(timings.num_prompt_tokens)
        self.request_generation_tokens.observe(timings.num_generation_tokens)
        for histogram, value in ((self.queue_time, timings.queue_time), (self.prefill_time, timings.prefill_time),
                                 (self.decode_time, timings.decode_time)):
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _advance(counter, last: int, current: int) -> int:
    if current > last:
        counter.inc(current - last)
    return max(last, current)
