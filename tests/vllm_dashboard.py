"""What the 12 panels of vLLM's Grafana dashboard (vLLM's examples/online_serving/prometheus_grafana/
grafana.json) query, without the `vllm:` prefix. Its panels also read num_requests_swapped and
cpu_cache_usage_perc, which vLLM v1 does not export either (no swapping, one KV pool)."""

DASHBOARD_SERIES = (
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum", "e2e_request_latency_seconds_count",
    "prompt_tokens_total", "generation_tokens_total",
    "time_per_output_token_seconds_bucket", "time_per_output_token_seconds_sum",
    "time_per_output_token_seconds_count",
    "num_requests_running", "num_requests_waiting",
    "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count",
    "gpu_cache_usage_perc",
    "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
    "request_success_total",
    "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum",
    "request_max_num_generation_tokens_sum",
)
