"""The router's own Prometheus series (GET /metrics on the router), in its own registry.

    deepinfer_router_requests_total{replica, route}        requests sent to a replica (first attempts
                                                           and retries alike)
    deepinfer_router_retries_total{replica}                attempts that failed before the first byte
    deepinfer_router_rejected_total{reason}                429s from admission; 503s with no healthy replica
    deepinfer_router_stream_errors_total{replica}          streams cut after their first byte
    deepinfer_router_expected_cached_tokens_total{replica} prompt tokens the index expected cached there
    deepinfer_router_reported_cached_tokens_total{replica} what the replica reported (usage cached_tokens /
                                                           cache_read_input_tokens; non-streaming answers)
    deepinfer_router_encode_handoffs_total{outcome}        requests with images sent to an encode instance
                                                           first (ok, failed, timeout, http_<status>)
    deepinfer_router_replica_healthy{replica}              1 while routed to
    deepinfer_router_replica_in_flight{replica}
    deepinfer_router_routing_seconds                       the router's own work before forwarding
                                                           (admission, tokenize for cache policies, choice)
    deepinfer_router_first_byte_seconds{route}             request received -> first byte back from a replica
    deepinfer_router_request_seconds{route}                request received -> last byte sent
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "deepinfer_router_"
FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(P + "requests", "Requests sent to each replica.", ["replica", "route"], registry=r)
        self.retries = Counter(P + "retries", "Attempts that failed before the first byte.", ["replica"], registry=r)
        self.rejected = Counter(P + "rejected", "Requests refused by the router.", ["reason"], registry=r)
        self.stream_errors = Counter(P + "stream_errors", "Streams cut after their first byte.", ["replica"],
                                     registry=r)
        self.expected_cached = Counter(P + "expected_cached_tokens", "Prompt tokens the router expected cached.",
                                       ["replica"], registry=r)
        self.reported_cached = Counter(P + "reported_cached_tokens", "Cached prompt tokens replicas reported.",
                                       ["replica"], registry=r)
        self.prefill = Counter(P + "prefill_handoffs", "Prefills on a prefill replica before decode, by outcome.",
                               ["outcome"], registry=r)
        self.encode = Counter(P + "encode_handoffs", "Requests with images sent to an encode instance first, by "
                              "outcome.", ["outcome"], registry=r)
        self.healthy = Gauge(P + "replica_healthy", "1 while the replica is routed to.", ["replica"], registry=r)
        self.in_flight = Gauge(P + "replica_in_flight", "Requests in flight to the replica.", ["replica"],
                               registry=r)
        self.routing = Histogram(P + "routing_seconds", "Router work before forwarding.", buckets=FAST, registry=r)
        self.first_byte = Histogram(P + "first_byte_seconds", "Request received to first byte from a replica.",
                                    ["route"], buckets=SLOW, registry=r)
        self.duration = Histogram(P + "request_seconds", "Request received to last byte sent.", ["route"],
                                  buckets=SLOW, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
