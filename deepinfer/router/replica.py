"""What the router knows of one replica, and how a /metrics page becomes those numbers.

Two sources, deliberately combined:
  - the router's own count of requests it sent there and that have not finished (`in_flight`):
    exact and current, but blind to traffic from other clients or routers;
  - the replica's gauges, scraped from /metrics every --metrics-interval-s (vLLM's names under
    our `deepinfer:` prefix, or `vllm:`): num_requests_running, num_requests_waiting,
    kv_cache_usage_perc, and cache_config_info (block size, KV dtype, number of blocks). They see
    all traffic but are up to one interval old.
`load` takes the larger of the two request counts, so neither blind spot makes a busy replica look idle.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

# Gauges summed over the `engine` label (a replica run with --data-parallel-size has several cores).
_GAUGES = {"num_requests_running": "running", "num_requests_waiting": "waiting"}
_PREFIXES = ("deepinfer:", "vllm:")
EWMA_ALPHA = 0.2


@dataclass
class Scraped:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0          # 0..1, the mean over the replica's engine cores
    num_blocks: int = 0            # KV blocks over all its cores (cache_config_info num_gpu_blocks)
    block_size: int | None = None
    kv_cache_dtype: str | None = None


@dataclass
class Replica:
    url: str
    index: int
    kv_events: str | None = None
    healthy: bool = False          # routed to only when True; set by probes, cleared by failures
    in_flight: int = 0
    in_flight_blocks: int = 0      # prompt blocks (+1 each) of those requests, as the router counted them
    scraped: Scraped = field(default_factory=Scraped)
    scraped_at: float = 0.0
    model_id: str | None = None    # /v1/models 'root': the prefix-cache extra key's model id
    # The base model's names (/v1/models entries without a `parent`): a request's `model` that is
    # none of them names a LoRA adapter, whose blocks hash apart (kv_index.py).
    served_names: frozenset[str] = frozenset()
    service_s: float | None = None  # EWMA of the router-measured duration of requests finished here
    consecutive_failures: int = 0
    last_error: str | None = None
    routed: int = 0

    @property
    def load(self) -> float:
        s = self.scraped
        return max(float(self.in_flight), s.running + s.waiting)

    @property
    def free_blocks(self) -> float:
        return self.scraped.num_blocks * (1.0 - self.scraped.kv_usage)

    @property
    def active_blocks(self) -> float:
        # The scrape's KV in use, or the router's own count of what it sent, whichever is larger
        # (the scrape lags a burst by up to one interval).
        return max(self.scraped.num_blocks * self.scraped.kv_usage, float(self.in_flight_blocks))

    def queue_delay_s(self) -> float:
        """Estimated wait before a new request starts here: the waiting requests (the scrape's, or
        the router's own surplus over what runs) drain one per service_s / running seconds, as
        slots free up (Little's law on the running set). 0 until a request has been timed."""
        if not self.service_s:
            return 0.0
        waiting = max(self.scraped.waiting, self.in_flight - self.scraped.running, 0.0)
        return waiting * self.service_s / max(self.scraped.running, 1.0)

    def observe_duration(self, seconds: float) -> None:
        self.service_s = seconds if self.service_s is None else \
            (1 - EWMA_ALPHA) * self.service_s + EWMA_ALPHA * seconds

    def mark_failed(self, reason: str) -> bool:
        """A failure seen by a probe or a proxied request; True when this took the replica out."""
        self.consecutive_failures += 1
        self.last_error = reason
        was = self.healthy
        self.healthy = False
        return was

    def mark_healthy(self) -> bool:
        """True when this brought the replica (back) into routing."""
        self.consecutive_failures = 0
        was = self.healthy
        self.healthy = True
        return not was

    def snapshot(self) -> dict:
        s = self.scraped
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight, "routed": self.routed,
                "running": s.running, "waiting": s.waiting, "kv_usage": s.kv_usage, "num_blocks": s.num_blocks,
                "block_size": s.block_size, "service_s": self.service_s, "last_error": self.last_error,
                "scrape_age_s": time.monotonic() - self.scraped_at if self.scraped_at else None}


def parse_metrics(text: str) -> Scraped:
    """The gauges the router uses, from a Prometheus text page (missing ones stay at 0/None)."""
    out = Scraped()
    usage: list[float] = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, labels, value = _split(line)
        if name is None:
            continue
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        else:
            continue
        if name in _GAUGES:
            setattr(out, _GAUGES[name], getattr(out, _GAUGES[name]) + value)
        elif name == "kv_cache_usage_perc":
            usage.append(value)
        elif name == "cache_config_info" and value == 1:
            out.num_blocks += int(labels.get("num_gpu_blocks") or 0)
            if labels.get("block_size", "").isdigit():
                out.block_size = int(labels["block_size"])
            out.kv_cache_dtype = labels.get("cache_dtype") or out.kv_cache_dtype
    if usage:
        out.kv_usage = sum(usage) / len(usage)
    return out


def _split(line: str) -> tuple[str | None, dict[str, str], float]:
    brace = line.find("{")
    if brace >= 0:
        end = line.rfind("}")
        name, body, rest = line[:brace], line[brace + 1:end], line[end + 1:]
        labels = {}
        for part in _label_pairs(body):
            key, _, raw = part.partition("=")
            labels[key.strip()] = raw.strip().strip('"')
    else:
        name, _, rest = line.partition(" ")
        labels = {}
    try:
        value = float(rest.split()[0])
    except (IndexError, ValueError):
        return None, {}, 0.0
    return (name, labels, value) if math.isfinite(value) else (None, {}, 0.0)


def _label_pairs(body: str) -> list[str]:
    # Label values are quoted and may hold commas; split on commas outside quotes.
    parts, current, quoted = [], [], False
    for ch in body:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if current:
        parts.append("".join(current))
    return [p for p in parts if p.strip()]
