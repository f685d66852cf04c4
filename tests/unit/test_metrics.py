"""/metrics without a server: ServerMetrics, the engine-stats collector, the HTTP middleware, and
the core's per-step token count, checked against vLLM v1's names, buckets and observation rules."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from deepinfer import LLM, SamplingParams
from deepinfer.config import CacheConfig
from deepinfer.engine.core_proc import step_tokens
from deepinfer.metrics.http import HTTPMetricsMiddleware
from deepinfer.metrics.prometheus import ServerMetrics, buckets_1_2_5
from deepinfer.metrics.stats import RequestTimings
from deepinfer.types.plan import EngineStats
from deepinfer.types.request import Request, RequestTimes
from deepinfer.types.spec_stats import SpecDecodeStats
from tests.vllm_dashboard import DASHBOARD_SERIES

LABELS = {"model_name": "m", "engine": "0"}


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def value(metrics: ServerMetrics, name: str, **labels) -> float:
    return samples(metrics)[(name, tuple(sorted({**LABELS, **labels}.items())))]


def names(metrics: ServerMetrics) -> set[str]:
    return {name for name, _ in samples(metrics)}


def served(metrics: ServerMetrics, n: int = 1) -> RequestTimings:
    """One request through the recording calls the engine client makes: prompt of 5, max_tokens
    16, n sequences; sequence 0 gets 3 tokens (1 at t=1.0, 2 at t=1.5), the others 1."""
    timings = RequestTimings(5, n=n, max_tokens=16, arrival=0.0)
    timings.on_tokens([1] * n, 1.0)
    metrics.record_first_output(timings)
    metrics.record_tokens(n, None)
    itl = timings.on_tokens([2] + [0] * (n - 1), 1.5)
    metrics.record_tokens(2, itl)
    timings.on_core_finished(0, RequestTimes(arrival=10.0, first_scheduled=10.25, first_token=10.5, finished=11.5))
    timings.finished = 2.0
    metrics.record_finished(timings, "length")
    return timings


def stats(queries: int = 0, hits: int = 0, preemptions: int = 0, spec: SpecDecodeStats | None = None) -> EngineStats:
    return EngineStats(2, 1, 0.25, preemptions, [queries], [hits], [0], spec,
                       prefix_cache_request_queries=queries, prefix_cache_request_hits=hits,
                       prefix_cache_replayed=[0], prefix_cache_expirations=[0], kv_group_kinds=["full"])


@pytest.fixture
def metrics() -> ServerMetrics:
    metrics = ServerMetrics("m", 2048)
    metrics.engine_started(CacheConfig(block_size=16, enable_prefix_caching=True), 300, pid=None)
    metrics.record_engine_stats(stats(queries=32, hits=16), [6, 1])
    return metrics


# ------------------------------------------------------------------------------ names and prefixes
def test_every_panel_of_vllms_dashboard_has_its_series(metrics):
    served(metrics)
    missing = [name for name in DASHBOARD_SERIES if "deepinfer:" + name not in names(metrics)]
    assert not missing


def test_vllm_names_are_one_switch_with_the_same_numbers():
    assert not any(name.startswith("vllm:") for name in names(ServerMetrics("m", 2048)))
    metrics = ServerMetrics("m", 2048, vllm_names=True)
    metrics.record_engine_stats(stats(queries=8))
    served(metrics)
    scrape = samples(metrics)
    ours = {key: v for key, v in scrape.items() if key[0].startswith("deepinfer:")}
    assert ours and all(scrape[("vllm:" + name[len("deepinfer:"):], labels)] == v for (name, labels), v in ours.items())
    assert {name for name, _ in scrape if name.startswith("vllm:")} >= {"vllm:" + name for name in DASHBOARD_SERIES}


def test_no_created_series_and_process_metrics_are_there(metrics):
    served(metrics)
    text = metrics.render().decode()
    assert "_created" not in text
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "python_info",
            "python_gc_collections_total"} <= names(metrics)


# ---------------------------------------------------------------------------- per-request rules
def test_request_histograms_follow_vllm(metrics):
    served(metrics, n=2)
    # Once per request, after its last sequence: the longest sequence, n and max_tokens.
    assert value(metrics, "deepinfer:request_max_num_generation_tokens_sum") == 3
    assert value(metrics, "deepinfer:request_generation_tokens_sum") == 4
    assert value(metrics, "deepinfer:request_params_n_sum") == 2
    assert value(metrics, "deepinfer:request_params_max_tokens_sum") == 16
    # Core clock: first scheduled 10.25 -> finished 11.5; decode 1.0 s over the 2 tokens after the first.
    assert value(metrics, "deepinfer:request_inference_time_seconds_sum") == 1.25
    assert value(metrics, "deepinfer:request_time_per_output_token_seconds_sum") == 0.5
    # The inter-token interval goes to both of vLLM's names for it.
    assert value(metrics, "deepinfer:inter_token_latency_seconds_sum") == 0.5
    assert value(metrics, "deepinfer:time_per_output_token_seconds_sum") == 0.5
    assert value(metrics, "deepinfer:request_success_total", finished_reason="length") == 1
    assert value(metrics, "deepinfer:request_success_total", finished_reason="stop") == 0   # there from the start


def test_one_token_request_has_zero_tpot_like_vllm(metrics):
    timings = RequestTimings(5, max_tokens=1, arrival=0.0)
    timings.on_tokens([1], 1.0)
    timings.on_core_finished(0, RequestTimes(0.0, 0.25, 0.5, 0.5))
    metrics.record_finished(timings, "length")
    assert value(metrics, "deepinfer:request_time_per_output_token_seconds_count") == 1
    assert value(metrics, "deepinfer:request_time_per_output_token_seconds_sum") == 0


def test_token_buckets_are_1_2_5_up_to_max_model_len(metrics):
    assert buckets_1_2_5(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    bounds = [labels for name, labels in samples(metrics) if name == "deepinfer:request_max_num_generation_tokens_bucket"]
    assert [dict(labels)["le"] for labels in bounds][-2:] == ["2000.0", "+Inf"]


def test_iteration_tokens_one_observation_per_step(metrics):
    # The fixture sent two steps: 6 tokens (a 5-token prompt's first token) and 1.
    assert value(metrics, "deepinfer:iteration_tokens_total_count") == 2
    assert value(metrics, "deepinfer:iteration_tokens_total_sum") == 7
    assert value(metrics, "deepinfer:iteration_tokens_total_bucket", le="1.0") == 1
    assert value(metrics, "deepinfer:iteration_tokens_total_bucket", le="8.0") == 2


def test_step_tokens_counts_a_prompt_at_its_first_token(tiny_llama):
    """vLLM's rule on a real engine: a step counts its generated tokens plus the whole prompt of
    each request whose first token it produced; prefill chunks that sample nothing are no step."""
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=64,
              max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    requests = {"a": Request("a", list(range(2, 22)), params, frozenset(), 3, block_size=4)}   # 20 tokens
    llm.engine.add_request(requests["a"])
    counted = []
    while llm.engine.has_unfinished():
        outputs = llm.engine.step()
        if any(out.new_token_ids for out in outputs):
            counted.append(step_tokens(outputs, requests))
    assert counted == [21, 1, 1]


# ------------------------------------------------------------------------------- the engine core
def test_cache_config_info_carries_the_config_in_labels(metrics):
    info = [dict(labels) for name, labels in samples(metrics) if name == "deepinfer:cache_config_info"]
    assert len(info) == 1
    assert {k: info[0][k] for k in ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype",
                                    "gpu_memory_utilization", "engine")} == {
        "block_size": "16", "num_gpu_blocks": "300", "enable_prefix_caching": "True", "cache_dtype": "auto",
        "gpu_memory_utilization": "0.9", "engine": "0"}


def test_engine_counters_are_the_cores_totals(metrics):
    metrics.record_engine_stats(stats(queries=40, hits=20, preemptions=2))
    assert value(metrics, "deepinfer:prefix_cache_queries_total") == 40
    assert value(metrics, "deepinfer:prefix_cache_hits_total") == 20
    assert value(metrics, "deepinfer:num_preemptions_total") == 2
    assert value(metrics, "deepinfer:kv_cache_usage_perc") == value(metrics, "deepinfer:gpu_cache_usage_perc") == 0.25


def test_kv_group_counters_carry_group_kind_and_eviction_cause(metrics):
    per_group = EngineStats(2, 1, 0.25, 0, [64, 64], [40, 0], [3, 1], None, prefix_cache_request_queries=64,
                            prefix_cache_request_hits=32, prefix_cache_replayed=[0, 8],
                            prefix_cache_expirations=[0, 5], kv_group_kinds=["full", "sliding_window"])
    metrics.record_engine_stats(per_group)
    # Request level: tokens not computed (32), not any one group's hits.
    assert value(metrics, "deepinfer:prefix_cache_hits_total") == 32
    sliding = {"group": "1", "kind": "sliding_window"}
    assert value(metrics, "deepinfer:kv_cache_group_hits_total", group="0", kind="full") == 40
    assert value(metrics, "deepinfer:kv_cache_group_replayed_tokens_total", **sliding) == 8
    assert value(metrics, "deepinfer:kv_cache_group_evictions_total", cause="retention", **sliding) == 5
    assert value(metrics, "deepinfer:kv_cache_group_evictions_total", cause="lru", **sliding) == 1


def test_a_dead_engine_drops_its_gauges_and_keeps_its_counters():
    health = {"ok": True}
    metrics = ServerMetrics("m", 2048, engine_healthy=lambda engine: health["ok"])
    metrics.record_engine_stats(stats(queries=32))
    assert value(metrics, "deepinfer:engine_healthy") == 1 and value(metrics, "deepinfer:num_requests_running") == 2
    health["ok"] = False
    scraped = names(metrics)
    assert value(metrics, "deepinfer:engine_healthy") == 0
    assert not scraped & {"deepinfer:num_requests_running", "deepinfer:num_requests_waiting",
                          "deepinfer:kv_cache_usage_perc", "deepinfer:gpu_cache_usage_perc"}
    assert value(metrics, "deepinfer:prefix_cache_queries_total") == 32


def test_counters_keep_rising_across_an_engine_restart(metrics):
    spec = SpecDecodeStats(2)
    spec.record(2, 1)
    metrics.record_engine_stats(stats(queries=40, preemptions=3, spec=spec))
    metrics.engine_started(CacheConfig(), 280, pid=None)        # a new core counts from zero
    assert value(metrics, "deepinfer:prefix_cache_queries_total") == 40
    again = SpecDecodeStats(2)
    again.record(1, 1)
    metrics.record_engine_stats(stats(queries=5, preemptions=1, spec=again))
    assert value(metrics, "deepinfer:prefix_cache_queries_total") == 45
    assert value(metrics, "deepinfer:num_preemptions_total") == 4
    assert value(metrics, "deepinfer:spec_decode_num_drafts_total") == 2
    assert value(metrics, "deepinfer:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 2
    info = [dict(labels)["num_gpu_blocks"] for name, labels in samples(metrics) if name == "deepinfer:cache_config_info"]
    assert info == ["280"]


# --------------------------------------------------------------------------------------- HTTP
def test_http_metrics_use_the_instrumentators_names():
    metrics = ServerMetrics("m", 2048)
    app = FastAPI()
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics.http)

    @app.post("/items/{item_id}")
    async def item(item_id: int):
        return {"id": item_id}

    @app.get("/stream")
    async def stream():
        return StreamingResponse(iter([b"ab", b"cde"]), media_type="text/plain")

    @app.get("/metrics")
    async def metrics_route():
        return {}

    async def drive():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            assert (await http.post("/items/7", content=b"{}")).status_code == 200
            assert (await http.get("/items/7")).status_code == 405      # path known, method not
            assert (await http.get("/nowhere/42")).status_code == 404
            assert (await http.get("/stream")).text == "abcde"
            await http.get("/metrics")
    asyncio.run(drive())
    scrape = samples(metrics)

    def get(name, **labels):
        return scrape[(name, tuple(sorted(labels.items())))]
    assert get("http_requests_total", handler="/items/{item_id}", method="POST", status="2xx") == 1
    assert get("http_requests_total", handler="/items/{item_id}", method="GET", status="4xx") == 1
    assert get("http_requests_total", handler="none", method="GET", status="4xx") == 1   # unknown paths: one label
    assert get("http_request_duration_seconds_count", handler="/stream", method="GET") == 1
    assert get("http_request_duration_highr_seconds_count") == 4
    assert get("http_request_size_bytes_sum", handler="/items/{item_id}") == 2
    assert get("http_response_size_bytes_sum", handler="/stream") == 5                  # streamed bytes count
    assert not any(dict(labels).get("handler") == "/metrics" for _, labels in scrape)  # the scrape is left out


def test_http_metrics_record_a_500_when_the_route_raises():
    metrics = ServerMetrics("m", 2048)
    app = FastAPI()
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics.http)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("boom")

    async def drive():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            assert (await http.get("/boom")).status_code == 500
    asyncio.run(drive())
    key = ("http_requests_total", tuple(sorted({"handler": "/boom", "method": "GET", "status": "5xx"}.items())))
    assert samples(metrics)[key] == 1
