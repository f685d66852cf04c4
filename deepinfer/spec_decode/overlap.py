"""When to speculate under overlapped scheduling: pick, per batch size, the loop that emits more.

A step that verifies drafts needs the previous step's tokens on the host (the drafts follow
them, and the verdict decides the next step's), so it runs synchronously: the host schedules,
the device computes, the host waits, then applies. A step without drafts can overlap instead
(engine/core.py): the host plans step N+1 while the device runs step N, hiding the host's time.
On the H200 that hidden time is 15-25 % of a decode step (benchmarks/spec_replay.py's anchor
with and without overlap), so speculating pays only where it gains more than that, which
depends on the acceptance and on the batch: the adaptive policy's cost model prices a draft
against a synchronous step only.

So the engine measures both: per batch-size bucket, the tokens a second that speculative steps
(synchronous, drafts verified) and plain overlapped steps delivered, as exponentially weighted
averages of decode-shaped steps, timed from one step's start to the next one's (so the host
work between steps, the caller's included, is counted for both). It takes the better one, and
every EXPLORE_EVERY steps in a bucket it runs a short stretch of the other, so a change in
acceptance (another workload) is noticed; where the other loop was measured clearly slower
(CLEAR_GAP) over enough steps of each (CLEAR_EVIDENCE), every EXPLORE_EVERY_CLEAR steps, since
each stretch of it costs its whole gap. An unmeasured bucket tries speculation first. A
speculative step whose requests had no drafts measures nothing about verifying: it is left out,
and the bucket overlaps for a few steps before trying again (NO_DRAFT_BACKOFF).

Only adaptive verification is chosen for: fixed verification is the user asking for every draft
to be verified, so that engine speculates at every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A stretch of the loop not currently preferred, every this many steps of a bucket. Measured on
# the H200 (benchmarks/spec_decode.py, SmolLM2, and spec_replay.py, 8B shape), exploring every
# 16 steps (3 a stretch, weight 0.3) noticed SmolLM2's copy prompts paying within a 64-token
# answer (batch 1: 1.45x against 1.05x) but cost more where speculating loses (batch 16: 0.59x
# and 0.69x against 0.97x and 1.21x; the 8B shape at batch 64: 0.87-0.91x against 0.95-0.97x),
# so the slower, steadier setting stays.
EXPLORE_EVERY = 64
# The other loop slower than the preferred one by this fraction or more: explore it every
# EXPLORE_EVERY_CLEAR steps. Measured on the H200 (spec_replay.py, 8B shape, batch 64, alpha 0.5,
# where speculating delivers 0.74x): exploring every 64 steps left the adaptive engine at 0.97x
# of no speculation.
CLEAR_GAP = 0.1
EXPLORE_EVERY_CLEAR = 256
# Measured steps of each loop before a gap counts as clear: a bucket's first few measurements
# are noisy (the steps around a prefill), and a wrong call would stand for EXPLORE_EVERY_CLEAR
# steps (on the H200, batch 16 at alpha 0.5 then never speculated: 0.87x fixed verification).
CLEAR_EVIDENCE = 8
# Steps in an exploring stretch (the first of a stretch of overlapped steps is not measured: the
# loop is filling, its interval holds the previous synchronous step's drain). Measured on the
# H200, 2-step speculative stretches recovered too slowly from a low estimate (batch 1, alpha
# 0.5: adaptive 0.79x fixed verification, against 0.99x with 4).
EXPLORE_RUN = {"speculative": 4, "overlapped": 4}
# Overlapped steps a bucket runs after a speculative step that found no drafts.
NO_DRAFT_BACKOFF = 4
EMA_WEIGHT = 0.2   # of the newest measurement


def _bucket(batch: int) -> int:
    """Batch sizes by powers of two: 1, 2, 3-4, 5-8, ..."""
    return max(batch - 1, 0).bit_length()


@dataclass
class _Rates:
    speculative: float | None = None   # tokens per second, EMA
    overlapped: float | None = None
    steps: int = 0
    measured: dict[str, int] = field(default_factory=lambda: {"speculative": 0, "overlapped": 0})
    exploring: str | None = None       # "speculative" | "overlapped" while a stretch runs
    explore_left: int = 0


class LoopChooser:
    def __init__(self) -> None:
        self._buckets: dict[int, _Rates] = {}
        self._last: tuple[str, int, float] | None = None   # the measured step: (loop, bucket, tokens)
        self._last_start: float | None = None
        self._skip_next = False
        self.counts = {"speculative": 0, "overlapped": 0}

    def choose(self, batch: int) -> bool:
        """Whether the next step speculates (synchronous) rather than overlaps."""
        rates = self._buckets.setdefault(_bucket(batch), _Rates())
        rates.steps += 1
        if rates.exploring is not None:
            loop = rates.exploring
            rates.explore_left -= 1
            if rates.explore_left <= 0:
                rates.exploring = None
        elif rates.speculative is None:
            loop = "speculative"
        elif rates.overlapped is None:
            loop = self._explore(rates, "overlapped")
        else:
            best = "speculative" if rates.speculative >= rates.overlapped else "overlapped"
            other = "overlapped" if best == "speculative" else "speculative"
            clear = (min(rates.measured.values()) >= CLEAR_EVIDENCE
                     and getattr(rates, other) < (1 - CLEAR_GAP) * getattr(rates, best))
            every = EXPLORE_EVERY_CLEAR if clear else EXPLORE_EVERY
            loop = self._explore(rates, other) if rates.steps % every == 0 else best
        self.counts[loop] += 1
        return loop == "speculative"

    @staticmethod
    def _explore(rates: _Rates, loop: str) -> str:
        rates.exploring, rates.explore_left = loop, EXPLORE_RUN[loop] - 1
        return loop

    def observe(self, start: float, batch: int, speculative: bool, tokens: float | None,
                drafted: bool = True) -> None:
        """A step started at `start` (perf_counter; called once its tokens are known): close the
        previous step's interval at `start`, and remember this one. tokens: what this step
        emits (None: not decode-shaped, so not measured). drafted=False: a speculative step
        whose requests had no drafts. It says nothing of what verifying delivers (measured, a
        warm-up without drafts settled batch 1 against speculating for the whole benchmark),
        so it is not measured; the bucket runs NO_DRAFT_BACKOFF overlapped steps before it
        speculates again, so a workload without drafts mostly overlaps."""
        loop = "speculative" if speculative else "overlapped"
        if self._last is not None and self._last_start is not None and start > self._last_start:
            last_loop, bucket, last_tokens = self._last
            rate = last_tokens / (start - self._last_start)
            rates = self._buckets.setdefault(bucket, _Rates())
            old = getattr(rates, last_loop)
            setattr(rates, last_loop, rate if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * rate)
            rates.measured[last_loop] += 1
        # The first overlapped step after a synchronous one is not measured (see EXPLORE_RUN).
        switched = self._last is not None and self._last[0] != loop
        measured = tokens is not None and not (switched and loop == "overlapped") and drafted
        self._last = (loop, _bucket(batch), tokens) if measured else None
        if speculative and not drafted:
            rates = self._buckets.setdefault(_bucket(batch), _Rates())
            if rates.exploring is None:
                rates.exploring, rates.explore_left = "overlapped", NO_DRAFT_BACKOFF
        self._last_start = start

    def idle(self) -> None:
        """The engine had nothing to compute: the interval running now measures no step."""
        self._last = None

    def describe(self) -> str:
        def rate(v: float | None) -> str:
            return "-" if v is None else f"{v:.0f}"

        return "; ".join(f"batch<={1 << b}: speculative {rate(r.speculative)}, overlapped {rate(r.overlapped)} tok/s"
                         for b, r in sorted(self._buckets.items())) or "no decode steps yet"
