"""The router's options: one frozen dataclass, and the argparse flags that fill it.

Defaults aim at a handful of replicas on one network: probes every second, gauges scraped every
half second, and admission off (every threshold None) until a flag turns a check on.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

POLICIES = ("round_robin", "least_load", "cache_aware", "cost")


@dataclass(frozen=True)
class RouterOptions:
    backends: tuple[str, ...]             # the replicas requests are routed to (decode replicas under P/D)
    policy: str = "least_load"
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None            # what clients must send to the router (also sent on to replicas)
    backend_api_key: str | None = None    # what the router sends to replicas; default: the client's own header
    # One KV-events endpoint per backend, in --backend order ("" for none); cache_aware and cost
    # learn the replicas' blocks from them.
    kv_events: tuple[str, ...] = ()
    kv_events_topic: str = ""
    hash_model_name: str | None = None    # the replicas' hash-root model name, when --served-model-name renamed it
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    metrics_interval_s: float = 0.5
    # cache_aware: go by load when the busiest and idlest replica differ by more than this many requests
    # (SGLang's balance_abs_threshold), or when the best match covers less than cache_threshold of the prompt.
    balance_abs_threshold: float = 8.0
    cache_threshold: float = 0.0
    # cost: weight of a block found only in the shared store (loading it is cheaper than computing it),
    # and of one active decode block against one block to prefill.
    store_hit_weight: float = 0.5
    decode_weight: float = 1.0
    # Admission (None: that check is off); see admission.py.
    max_queue_delay_s: float | None = None
    max_kv_usage: float | None = None
    max_waiting_requests: int | None = None
    max_requests_per_replica: int | None = None
    min_free_kv_blocks: int | None = None
    retry_after_s: int = 1
    max_attempts: int = 3                 # replicas tried per request before its first byte
    connect_timeout_s: float = 5.0
    request_timeout_s: float | None = None   # longest wait for a replica's next bytes (None: none)
    uvicorn_log_level: str = "info"
    # Prefill/decode disaggregation (disaggregation.py): replicas started with --kv-role prefill that
    # compute each generation request's prompt before a --backend (decode) replica generates.
    prefill_backends: tuple[str, ...] = ()
    prefill_timeout_s: float = 120.0
    # E/P/D (encode_stage.py): encode instances (--kv-role encode) that write a request's images'
    # encoder outputs to the shared store before the request goes on.
    encoder_backends: tuple[str, ...] = ()
    encoder_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("router: give at least one --backend URL")
        if self.policy not in POLICIES:
            raise ValueError(f"router: --policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.kv_events and len(self.kv_events) != len(self.backends):
            raise ValueError(f"router: --kv-events takes one endpoint per --backend ({len(self.backends)}), "
                             f"got {len(self.kv_events)}; use '' for a replica without one")
        if self.max_attempts < 1:
            raise ValueError("router: --max-attempts must be at least 1")
        object.__setattr__(self, "backends", tuple(b.rstrip("/") for b in self.backends))
        object.__setattr__(self, "kv_events", tuple(self.kv_events))
        object.__setattr__(self, "prefill_backends", tuple(b.rstrip("/") for b in self.prefill_backends))
        object.__setattr__(self, "encoder_backends", tuple(b.rstrip("/") for b in self.encoder_backends))

    def kv_events_of(self, index: int) -> str | None:
        return (self.kv_events[index] or None) if self.kv_events else None


def add_router_args(parser: argparse.ArgumentParser) -> None:
    d = RouterOptions(backends=("x",))
    a = parser.add_argument
    a("--backend", dest="backends", nargs="+", required=True, metavar="URL", help="replica base URLs")
    a("--policy", choices=POLICIES, default=d.policy, help="how a replica is chosen (default: %(default)s)")
    a("--host", default=d.host)
    a("--port", type=int, default=d.port)
    a("--api-key", default=None, help="the key clients must send (Bearer or x-api-key)")
    a("--backend-api-key", default=None, help="the key sent to replicas (default: the client's own)")
    a("--kv-events", nargs="+", default=(), metavar="ENDPOINT",
      help="each replica's --kv-events-endpoint (tcp://host:port, ipc://...), in --backend order")
    a("--kv-events-topic", default=d.kv_events_topic)
    a("--hash-model-name", default=None,
      help="the model name in the replicas' block-hash root (default: /v1/models 'root')")
    for name in ("health_interval_s", "health_timeout_s", "metrics_interval_s", "balance_abs_threshold",
                 "cache_threshold", "store_hit_weight", "decode_weight", "connect_timeout_s"):
        a("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    a("--max-queue-delay-s", type=float, default=None, help="429 when every replica's estimated queue delay is above")
    a("--max-kv-usage", type=float, default=None, help="429 when every replica's KV usage (0..1) is above")
    a("--max-waiting-requests", type=int, default=None, help="429 when every replica has more waiting requests")
    a("--max-requests-per-replica", type=int, default=None,
      help="429 when every replica already has this many requests running or waiting")
    a("--min-free-kv-blocks", type=int, default=None, help="429 when no replica has this many free KV blocks")
    a("--retry-after-s", type=int, default=d.retry_after_s)
    a("--max-attempts", type=int, default=d.max_attempts)
    a("--request-timeout-s", type=float, default=None,
      help="the longest wait for a replica's next bytes (its first answer, the next chunk of a stream); "
           "a slow replica is a 504 before the first byte, an error event after it (default: no limit)")
    a("--uvicorn-log-level", default=d.uvicorn_log_level)
    a("--prefill", dest="prefill_backends", nargs="+", default=(), metavar="URL",
      help="prefill replicas (deepinfer serve --kv-role prefill, sharing --kv-store with the --backend "
           "replicas, started with --kv-role decode): each request's prompt is computed there first")
    a("--prefill-timeout-s", type=float, default=d.prefill_timeout_s,
      help="how long a prefill may take before the decode replica computes the prompt itself")
    a("--encoder", dest="encoder_backends", nargs="+", default=(), metavar="URL",
      help="encode instances (deepinfer serve --kv-role encode, sharing --kv-store with the other replicas): "
           "a request carrying images is sent there first, and its images' encoder outputs loaded, not computed")
    a("--encoder-timeout-s", type=float, default=d.encoder_timeout_s,
      help="how long the encode stage may take before the serving replica encodes the images itself")


def router_options(args: argparse.Namespace) -> RouterOptions:
    names = {f.name for f in fields(RouterOptions)}
    return RouterOptions(**{k: v for k, v in vars(args).items() if k in names and v is not None})
