"""Per-request timings in the front end.

Two clocks, never mixed: TTFT, inter-token latency and end-to-end latency use the front end's
monotonic clock (arrival is when the HTTP request reached us, which is what a client feels);
queue, prefill, decode and inference times are differences of the engine core's own timestamps
(RequestTimes), which are only ever subtracted from each other.

A request of n > 1 fans out to n sequences in the core. Token counts are kept per sequence
(vLLM's request_max_num_generation_tokens is the longest one); the core's timestamps are those
of the first sequence to finish, and the per-request TPOT divides its decode time by its own
token count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deepinfer.types.request import RequestTimes


@dataclass
class RequestTimings:
    num_prompt_tokens: int
    n: int = 1
    max_tokens: int | None = None   # the request's max_tokens as the engine runs it (vLLM's max_tokens_param)
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    sequence_tokens: list[int] = field(default_factory=list)   # generated tokens of sequence i
    core_times: RequestTimes | None = None
    core_times_index: int = 0        # the sequence `core_times` belong to

    def __post_init__(self) -> None:
        self.sequence_tokens = self.sequence_tokens or [0] * self.n

    def on_tokens(self, new_per_sequence: list[int], now: float) -> float | None:
        """Record tokens that arrived at `now` (new_per_sequence[i]: new tokens of sequence i);
        returns the inter-token interval, if any."""
        if not any(new_per_sequence):
            return None
        interval = None if self.last_token is None else now - self.last_token
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        for index, count in enumerate(new_per_sequence):
            self.sequence_tokens[index] += count
        return interval

    def on_core_finished(self, index: int, times: RequestTimes) -> None:
        """The core's timestamps of sequence `index`; the first sequence to finish speaks for all."""
        if self.core_times is None:
            self.core_times, self.core_times_index = times, index

    @property
    def num_generation_tokens(self) -> int:
        return sum(self.sequence_tokens)

    @property
    def max_sequence_tokens(self) -> int:
        return max(self.sequence_tokens)

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

    @property
    def inference_time(self) -> float | None:
        """First scheduled to finished: prefill plus decode, preemptions included (vLLM's RUNNING phase)."""
        t = self.core_times
        if t is None or t.first_scheduled is None or t.finished is None:
            return None
        return t.finished - t.first_scheduled

    @property
    def mean_time_per_output_token(self) -> float | None:
        """Decode time over the tokens after the first (the first one is the prefill's); vLLM
        reports 0 for a sequence of one token, and so do we."""
        decode = self.decode_time
        if decode is None:
            return None
        tokens = self.sequence_tokens[self.core_times_index]
        return decode / (tokens - 1) if tokens > 1 else 0.0
