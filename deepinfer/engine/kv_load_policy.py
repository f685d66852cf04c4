"""Load a persistent store's prefix, or recompute it: whichever this engine measured faster.

A store hit is worth loading only while reading it is quicker than computing it. On a CPU it
nearly always is; on a fast GPU a long prefix of a small model computes faster than it reads
(an 8B model's 32k-token prefix computed on the GPU in less time than it took to load from a
directory: docs/benchmarks/design-measurements.md#kv-store-load-or-recompute). Both costs
depend on the hardware, the model, the store and the load on it, so both are measured online,
from this engine's own loads and prefill steps:

  load time(n blocks)  = overhead + n * per_block, fitted to each finished load: queued
                         (KVTierLink.start_loads) to reported loaded (poll); it includes the
                         wait for the step that hands the load over and the poll that sees it.
                         Every block of a model's persisted groups has the same bytes, so
                         per_block is the store's measured bandwidth times a block's bytes
  recompute time(n, s) = per_token * N + per_pair * N (S + (N + 1) / 2), N = n * block_size
                         tokens after S = s * block_size the device holds already: the prefix's
                         own prefill, whose attention grows with its context (query i attends
                         every key before it); fitted to prefill steps as
                         step time = per_token * tokens + per_pair * (query, key) pairs
                         (a chunk of L tokens from position s has L (s + (L + 1) / 2) pairs), so
                         a short prefix is not priced at a long one's rate or the other way

A hit is loaded when the first is smaller, or while either is unmeasured (a fresh engine loads,
as it always did); a hit estimated slower to load is never loaded. Its estimate would then never
change (a declined load is not measured), so one declined hit in EXPLORE_EVERY is probed instead:
its entries are read and checked but copied nowhere, beside the recomputation, which waits for
nothing (KVTierLink.lookup), and the probe's time is a load sample. Used by KVTierLink for the
persistent store only: the host tier (RAM) is always cheaper than recomputing.
"""

from __future__ import annotations

import logging

from deepinfer.types.plan import SchedulerPlan

logger = logging.getLogger(__name__)

# A new sample's weight: the estimates follow a store whose speed changes (a cold page cache, a
# busy Redis) within a few loads, and a noisy single step moves them little.
LOAD_WEIGHT = 0.3
PREFILL_WEIGHT = 0.2
# Steps measured for the prefill estimate: enough prefill tokens that the per-step fixed costs
# (launch, sampling) do not dominate, and few decode rows beside them (they cost time too).
MIN_PREFILL_TOKENS = 256
MAX_DECODE_ROWS_PER_PREFILL_TOKEN = 1 / 16
# While recomputing, one hit in EXPLORE_EVERY is still read (a probe, no request waits for it): a
# declined load is never measured, so without it an estimate taken on a slow moment (a cold
# cache, a busy store) would stay forever, and the engine would keep recomputing a store that has
# since become fast. A probe costs the store's bandwidth, never a request's time.
EXPLORE_EVERY = 16
# The load sizes must spread this much (std / mean) to tell the fixed overhead from the per-block
# cost; otherwise the overhead is folded into the per-block cost (seconds / blocks).
MIN_SIZE_SPREAD = 0.25


# The two prefill features must not move together this much (squared correlation) to be told
# apart; otherwise the steps are priced per token alone.
MAX_FEATURE_CORRELATION = 0.98


class KVLoadPolicy:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # Exponentially weighted sums over prefill steps (x: tokens, a: attention pairs,
        # d: seconds) for the fit d = per_token * x + per_pair * a.
        self._pw = self._xx = self._xa = self._aa = self._xd = self._ad = 0.0
        self._fixed_rate: float | None = None   # a per-token rate set from outside (prefill_s_per_token)
        # Exponentially weighted sums over finished loads (n: blocks, t: seconds) for the
        # straight-line fit t = overhead + n * per_block.
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self._started: dict[str, tuple[int, float]] = {}   # request id -> (blocks, queued at)
        self._last_done: float | None = None               # when the last measured step ended
        self._since_load = 0          # hits declined since the last one loaded (or probed)
        self._loading = True          # the last decision
        self._probe = False           # the last declined hit is to be probed (take_probe)
        self.explore_every = EXPLORE_EVERY
        self.loaded = self.declined = self.explored = 0     # hits (requests); explored: probed
        self.declined_blocks = 0

    # -------------------------------------------------------------------------- estimates
    def load_estimate(self) -> tuple[float, float] | None:
        """(overhead seconds, seconds per block) of a load, None until a load finished."""
        if self._w <= 0:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n > (MIN_SIZE_SPREAD * mean_n) ** 2:
            per_block = (self._nt / self._w - mean_n * mean_t) / var_n
            overhead = mean_t - per_block * mean_n
            if per_block > 0 and overhead >= 0:   # else noise: use the plain ratio
                return overhead, per_block
        return 0.0, mean_t / mean_n

    def load_seconds(self, num_blocks: int) -> float | None:
        est = self.load_estimate()
        return None if est is None else est[0] + num_blocks * est[1]

    def prefill_estimate(self) -> tuple[float, float] | None:
        """(seconds per token, seconds per attention pair) of prefill, None until a step was
        timed. The pairs' term is 0 while the steps seen cannot tell it from the tokens'."""
        if self._fixed_rate is not None:
            return self._fixed_rate, 0.0
        if self._pw <= 0:
            return None
        det = self._xx * self._aa - self._xa * self._xa
        if det > (1 - MAX_FEATURE_CORRELATION) * self._xx * self._aa:
            per_token = (self._xd * self._aa - self._ad * self._xa) / det
            per_pair = (self._ad * self._xx - self._xd * self._xa) / det
            if per_token >= 0 and per_pair >= 0:
                return per_token, per_pair
        return self._xd / self._xx, 0.0

    @property
    def prefill_s_per_token(self) -> float | None:
        """Prefill seconds per token, averaged over the steps seen (whatever their contexts)."""
        if self._fixed_rate is not None or self._pw <= 0:
            return self._fixed_rate
        return self._xd / self._xx

    @prefill_s_per_token.setter
    def prefill_s_per_token(self, rate: float | None) -> None:
        """Price prefill at a flat rate per token (tests and operators that know it)."""
        self._fixed_rate = rate

    def recompute_seconds(self, num_blocks: int, start_blocks: int = 0) -> float | None:
        """Seconds to compute `num_blocks` blocks that follow `start_blocks` blocks already on
        the device: each of their tokens attends the context before it, the device's prefix
        included."""
        est = self.prefill_estimate()
        if est is None:
            return None
        tokens, start = num_blocks * self.block_size, start_blocks * self.block_size
        return est[0] * tokens + est[1] * tokens * (start + (tokens + 1) / 2)

    # ----------------------------------------------------------------------------- samples
    def load_started(self, request_id: str, num_blocks: int, now: float) -> None:
        if num_blocks > 0:
            self._started[request_id] = (num_blocks, now)

    def load_finished(self, request_id: str, ok: bool, now: float) -> None:
        """A load reported done; a failed one (bad entry, store down, timeout) says nothing of
        the store's speed (a timeout would only say that it is at most the timeout)."""
        started = self._started.pop(request_id, None)
        if started is None or not ok:
            return
        n, t = started[0], max(now - started[1], 0.0)
        keep = 1 - LOAD_WEIGHT
        self._w = keep * self._w + 1
        self._n = keep * self._n + n
        self._t = keep * self._t + t
        self._nn = keep * self._nn + n * n
        self._nt = keep * self._nt + n * t

    def load_dropped(self, request_id: str) -> None:
        """The load was aborted (its request went away): no sample."""
        self._started.pop(request_id, None)

    def observe_step(self, plan: SchedulerPlan, queued_at: float, done_at: float) -> None:
        """A step queued at `queued_at` whose result arrived at `done_at`. Overlapped steps queue
        the next forward before the previous one ends: the device started this step no earlier
        than the previous step's end, so that is its start when later than `queued_at`."""
        start = queued_at if self._last_done is None else max(queued_at, self._last_done)
        self._last_done = done_at
        if plan.num_scheduled_tokens < MIN_PREFILL_TOKENS:
            return   # most steps (decode): not a prefill sample, and nothing to count
        chunks = [c for c in plan.chunks if not c.is_generating]
        prefill = sum(c.num_tokens for c in chunks)
        decode_rows = len(plan.chunks) - len(chunks)
        if prefill < MIN_PREFILL_TOKENS or decode_rows > prefill * MAX_DECODE_ROWS_PER_PREFILL_TOKEN:
            return
        pairs = sum(c.num_tokens * (c.start + (c.num_tokens + 1) / 2) for c in chunks)
        seconds = max(done_at - start, 0.0)
        # Each step's equation scaled by 1 / tokens, so a long step does not outweigh the rest by
        # its size alone; older steps fade (PREFILL_WEIGHT) so the fit follows a changing load.
        x, a, d = 1.0, pairs / prefill, seconds / prefill
        keep = 1 - PREFILL_WEIGHT
        self._pw = keep * self._pw + 1
        self._xx = keep * self._xx + x * x
        self._xa = keep * self._xa + x * a
        self._aa = keep * self._aa + a * a
        self._xd = keep * self._xd + x * d
        self._ad = keep * self._ad + a * d

    # ----------------------------------------------------------------------------- decision
    def should_load(self, num_blocks: int, start_blocks: int = 0) -> bool:
        """Whether to load a hit of `num_blocks` blocks past `start_blocks` on the device (else
        it is recomputed, and may be probed: take_probe). Counts the decision: ask once per hit."""
        load_s, compute_s = self.load_seconds(num_blocks), self.recompute_seconds(num_blocks, start_blocks)
        cheaper = load_s is None or compute_s is None or load_s < compute_s
        if cheaper != self._loading:
            self._loading = cheaper
            logger.info("KV store: %s prefixes from now on (a load of %d blocks: %s s measured, recomputing "
                        "them: %s s)", "loading" if cheaper else "recomputing", num_blocks,
                        _fmt(load_s), _fmt(compute_s))
        if cheaper:
            self.loaded += 1
            self._since_load = 0
            return True
        self._since_load += 1
        self.declined += 1
        self.declined_blocks += num_blocks
        if self._since_load >= self.explore_every:
            self.explored += 1
            self._since_load = 0
            self._probe = True
        return False

    def take_probe(self) -> bool:
        """After a declined hit: whether to read its entries anyway, copied nowhere, as a load
        sample (load_started / load_finished under the probe's own id). Once per probe due."""
        probe, self._probe = self._probe, False
        return probe


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3g}"
