"""When to speculate under overlapped scheduling: pick, per batch size, the loop that emits more.

A step that verifies drafts needs the previous step's tokens on the host (the drafts follow
them, and the verdict decides the next step's), so it runs synchronously: the host schedules,
the device computes, the host waits, then applies. A step without drafts can overlap instead
(engine/overlapped_loop.py): the host plans step N+1 while the device runs step N, hiding the host's time.
Measured on the GPU, that hidden time is a sizeable share of a decode step, the larger the
batch the larger (benchmarks/spec_replay.py's anchor with and without overlap;
docs/benchmarks/design-measurements.md#overlapped-loop-the-host-time-it-hides), so speculating
pays only where it gains more than that, which depends on the acceptance and on the batch: the
adaptive policy's cost model prices a draft against a synchronous step only.

So the engine measures both: per batch-size bucket, the tokens a second (per running request) that
speculative steps (synchronous, drafts verified) and plain overlapped steps delivered, as
exponentially weighted averages of decode-shaped steps. A step is timed from the moment the previous
step's results arrived (its collect returned) to the moment its own did: that spacing holds the
device's time and whatever host work the loop left exposed, the caller's included, for both loops
alike, and a step left in flight (a verify step, or a verify chain of several) is charged its own
device time, not its successor's. It takes the better loop, and now and then runs a short stretch of
the other (EXPLORE_RUN steps), so a change in acceptance (another workload) is noticed: every
EXPLORE_EVERY steps of the bucket until both loops have CLEAR_EVIDENCE measured steps, then as often
as keeps the stretches' expected cost (their shortfall against the better loop, and the refill of
the better loop after them) within EXPLORE_BUDGET of the bucket's time. An unmeasured bucket tries
speculation first. A speculative step whose requests had no drafts measures nothing about verifying:
it is left out, and the bucket overlaps for a few steps before trying again, twice as many after
each such step in a row (NO_DRAFT_BACKOFF).

Only adaptive verification is chosen for: fixed verification is the user asking for every draft
to be verified, so that engine speculates at every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A stretch of the loop not currently preferred, every this many steps of a bucket until both
# loops are measured (CLEAR_EVIDENCE), and never more often. Measured on the GPU
# (benchmarks/spec_decode.py, SmolLM2, and spec_replay.py, 8B shape), exploring every 16 steps
# (3 a stretch, weight 0.3) noticed SmolLM2's copy prompts paying within a 64-token answer (at
# batch 1, a gain that exploring every 64 steps mostly missed) but cost more where speculating
# loses (batch 16, and the 8B shape at batch 64, ran clearly slower than with 64)
# (design-measurements.md#loop-chooser-exploration-interval-evidence-and-stretch-length).
EXPLORE_EVERY = 64
# Measured steps of each loop before the stretches are spaced by their cost: a bucket's first few
# measurements are noisy (the steps around a prefill), and a wrong call would stand for a long
# while (on the GPU, batch 16 at alpha 0.5 then never speculated and fell short of fixed
# verification; design-measurements.md#loop-chooser-exploration-interval-evidence-and-stretch-length).
CLEAR_EVIDENCE = 8
# The share of a bucket's time the stretches of the slower loop may cost, once measured. On the
# GPU (spec_replay.py --trace, 8B shape, batch 64, alpha 0.5) a 4-step speculative stretch cost
# its steps' shortfall against the overlapped loop's rate plus the refill of that loop after it,
# which every 64 steps left the adaptive engine a few percent below no speculation; at this budget
# a stretch comes every few hundred steps (a few seconds of that batch), the time a change of workload
# may go unnoticed (docs/benchmarks/design-measurements.md#loop-chooser-exploration-budget).
EXPLORE_BUDGET = 0.01
# Steps in an exploring stretch (its first step is not measured: see LoopChooser.observe).
# Measured on the GPU, 2-step speculative stretches recovered too slowly from a low estimate
# (batch 1, alpha 0.5: adaptive fell well short of fixed verification, where with 4 it about
# matched it; design-measurements.md#loop-chooser-exploration-interval-evidence-and-stretch-length).
EXPLORE_RUN = {"speculative": 4, "overlapped": 4}
# Overlapped steps a bucket runs after a speculative step that found no drafts, doubled after
# each further one in a row, up to NO_DRAFT_BACKOFF_MAX. Such a step costs a drain of the loop
# for nothing, and the adaptive policy admits none where its cost model says no draft pays (on
# the CPU at batch 64, spec_replay.py --trace: one step in five was one, taking about twice an
# overlapped step's time;
# design-measurements.md#loop-chooser-what-a-step-is-charged-and-how-often-the-slower-loop-is-explored).
NO_DRAFT_BACKOFF = 4
NO_DRAFT_BACKOFF_MAX = 128
EMA_WEIGHT = 0.2   # of the newest measurement
LOOPS = ("speculative", "overlapped")


def _bucket(batch: int) -> int:
    """Batch sizes by powers of two: 1, 2, 3-4, 5-8, ..."""
    return max(batch - 1, 0).bit_length()


@dataclass
class _Loop:
    # Tokens per second per running request, EMA: a bucket spans batch sizes up to 2x apart
    # (the batch shrinks as requests finish), and a loop measured mostly at its small end must
    # not look slower for that (on the GPU, verify chains measured while a batch of 64 ran out
    # were then not tried for the next workload's first 80 steps, where they beat no speculation
    # once tried; design-measurements.md#loop-chooser-exploration-interval-evidence-and-stretch-length).
    rate: float | None = None
    seconds: float | None = None    # seconds a step, EMA
    measured: int = 0
    # A stretch of this loop began after hundreds of steps of the other: its estimate is that
    # old, so the stretch's first measurement replaces it rather than move it by EMA_WEIGHT
    # (else a workload whose acceptance rose would need several stretches to be noticed).
    stale: bool = False

    def add(self, tokens: float, seconds: float, batch: int) -> None:
        rate, fresh = tokens / (seconds * max(batch, 1)), self.rate is None or self.stale
        self.rate = rate if fresh else (1 - EMA_WEIGHT) * self.rate + EMA_WEIGHT * rate
        self.seconds = seconds if fresh else (1 - EMA_WEIGHT) * self.seconds + EMA_WEIGHT * seconds
        self.measured += 1
        self.stale = False


@dataclass
class _Bucket:
    loops: dict[str, _Loop] = field(default_factory=lambda: {loop: _Loop() for loop in LOOPS})
    since_stretch: int = 0             # steps since the last exploring stretch began
    exploring: str | None = None       # the loop of the stretch running now
    explore_left: int = 0
    backoff: int = NO_DRAFT_BACKOFF    # overlapped steps after the next speculative step without drafts

    def explore(self, loop: str) -> str:
        self.exploring, self.explore_left, self.since_stretch = loop, EXPLORE_RUN[loop] - 1, 0
        # Spaced by its cost, a stretch comes long after the loop's last measurement.
        self.loops[loop].stale = min(x.measured for x in self.loops.values()) >= CLEAR_EVIDENCE
        return loop

    def period(self, best: str, other: str) -> int:
        """Steps between stretches of `other` (see the module docstring)."""
        if min(loop.measured for loop in self.loops.values()) < CLEAR_EVIDENCE:
            return EXPLORE_EVERY
        hi, lo = self.loops[best], self.loops[other]
        # A stretch emits lo.rate where hi.rate was to be had, then the better loop refills
        # (about one of its steps: the host plans it with the device idle, or drains the pipe).
        cost = EXPLORE_RUN[other] * lo.seconds * max(1.0 - lo.rate / hi.rate, 0.0) + hi.seconds
        return max(EXPLORE_EVERY, math.ceil(cost / (EXPLORE_BUDGET * hi.seconds)))


class LoopChooser:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._last_done: float | None = None   # when the last collected step's results arrived
        self._last_loop: str | None = None
        self.counts = {loop: 0 for loop in LOOPS}

    def choose(self, batch: int) -> bool:
        """Whether the next step speculates (synchronous) rather than overlaps."""
        bucket = self._buckets.setdefault(_bucket(batch), _Bucket())
        bucket.since_stretch += 1
        spec, overlapped = bucket.loops["speculative"], bucket.loops["overlapped"]
        if bucket.exploring is not None:
            loop = bucket.exploring
            bucket.explore_left -= 1
            if bucket.explore_left <= 0:
                bucket.exploring = None
        elif spec.rate is None:
            loop = "speculative"
        elif overlapped.rate is None:
            loop = bucket.explore("overlapped")
        else:
            best = "speculative" if spec.rate >= overlapped.rate else "overlapped"
            other = "overlapped" if best == "speculative" else "speculative"
            loop = bucket.explore(other) if bucket.since_stretch >= bucket.period(best, other) else best
        self.counts[loop] += 1
        return loop == "speculative"

    def no_drafts(self, batch: int) -> None:
        """A speculative step found no drafts for its requests (said when it is launched): the
        bucket overlaps a back-off of steps before speculating again (NO_DRAFT_BACKOFF, doubled
        for each such step in a row), so a workload without drafts, or whose drafts the adaptive
        policy finds not worth verifying, mostly overlaps."""
        bucket = self._buckets.setdefault(_bucket(batch), _Bucket())
        if bucket.exploring is None:
            bucket.exploring, bucket.explore_left = "overlapped", bucket.backoff
            bucket.backoff = min(2 * bucket.backoff, NO_DRAFT_BACKOFF_MAX)

    def observe(self, done: float, batch: int, speculative: bool, tokens: float | None,
                drafted: bool = True) -> None:
        """A step's results arrived at `done` (perf_counter, once its collect returned; steps are
        collected in launch order). It is charged the time since the previous step's results
        arrived, if that step was a measured kind of step of the same loop: each loop's rate is
        its steady state. Not measured: tokens None (not decode-shaped), drafted=False (a
        speculative step whose requests had no drafts: it says nothing of what verifying
        delivers; measured, a warm-up without drafts settled batch 1 against speculating for
        the whole benchmark), the first step after idle(), and the first step after a switch of
        loop or after an unmeasured step: the first overlapped step refills the loop (the host
        plans it with the device idle), the first speculative one drains it, and with a draft
        model also computes the draft KV of every token the overlapped steps emitted (on the
        GPU, 8B shape and a 1B draft at batch 64, charging that to speculation kept the
        adaptive engine overlapping, a little slower than no speculation, where verifying every
        draft ran faster than no speculation;
        design-measurements.md#loop-chooser-what-a-step-is-charged-and-how-often-the-slower-loop-is-explored).
        The stretches' spacing counts a switch's cost (_Bucket.period)."""
        loop = "speculative" if speculative else "overlapped"
        if speculative and drafted:   # drafts again: the next step without any backs off afresh
            self._buckets.setdefault(_bucket(batch), _Bucket()).backoff = NO_DRAFT_BACKOFF
        steady = tokens is not None and drafted   # a decode-shaped step of its loop
        if self._last_done is not None and done > self._last_done and steady and self._last_loop == loop:
            bucket = self._buckets.setdefault(_bucket(batch), _Bucket())
            bucket.loops[loop].add(tokens, done - self._last_done, batch)
        self._last_done, self._last_loop = done, (loop if steady else None)

    def idle(self) -> None:
        """The engine had nothing to compute: the next step's interval would hold the idle time."""
        self._last_done = self._last_loop = None

    def describe(self) -> str:
        def rate(v: float | None) -> str:
            return "-" if v is None else f"{v:.0f}"

        return "; ".join(f"batch<={1 << b}: speculative {rate(r.loops['speculative'].rate)}, "
                         f"overlapped {rate(r.loops['overlapped'].rate)} tok/s a request"
                         for b, r in sorted(self._buckets.items())) or "no decode steps yet"
