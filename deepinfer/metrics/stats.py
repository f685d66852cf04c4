"""Per-request timings in the front end.

Two clocks, never mixed: TTFT, inter-token latency and end-to-end latency use the front end's
monotonic clock (arrival is when the HTTP request reached us, which is what a client feels);
queue, prefill and decode times are differences of the engine core's own timestamps
(RequestTimes), which are only ever subtracted from each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deepinfer.engine.request import RequestTimes


@dataclass
class RequestTimings:
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_generation_tokens: int = 0
    core_times: RequestTimes | None = None   # of the first child (n > 1 children share a prompt)

    def on_tokens(self, num_new: int, now: float) -> float | None:
        """Record tokens that arrived at `now`; returns the inter-token interval, if any."""
        if num_new <= 0:
            return None
        interval = None if self.last_token is None else now - self.last_token
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.num_generation_tokens += num_new
        return interval

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return (self.finished or time.monotonic()) - self.arrival

    @property
    def queue_time(self) -> float | None:
        t = self.core_times
        return None if t is None or t.first_scheduled is None else t.first_scheduled - t.arrival

    @property
    def prefill_time(self) -> float | None:
        t = self.core_times
        if t is None or t.first_scheduled is None or t.first_token is None:
            return None
        return t.first_token - t.first_scheduled

    @property
    def decode_time(self) -> float | None:
        t = self.core_times
        if t is None or t.first_token is None or t.finished is None:
            return None
        return t.finished - t.first_token
