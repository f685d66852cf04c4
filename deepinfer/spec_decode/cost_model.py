"""Step-cost model: how long a forward of b sequences verifying e drafts each takes.

Profiled once at start-up on the real runner (`profile_step_cost`): for a few batch sizes b and
draft counts per sequence e in {0, k/2, k}, time a decode-shaped forward of b * (1 + e) tokens
(the shape verification steps have). `cost(b, num_tokens)` interpolates linearly in e within a
measured batch size and linearly in b between measured batch sizes; past the largest measured
batch it scales the largest curve by b / b_max (more sequences, proportionally more work).

On a GPU the curve is nearly flat at small batches (weights dominate: verifying is almost free)
and turns linear once the batch is compute bound; on a CPU it is close to linear throughout.
That difference is exactly what the adaptive admission in policy.py exploits.

A start-up profile on a shared machine can catch a bad moment. The profile interleaves its
shapes (a stall hits one repeat of several shapes, not every repeat of one) and keeps each
shape's fastest run; and the table keeps learning: `observe` takes the measured time of each
decode-shaped step and moves the two draft-count points around it at the nearest measured
batch size (log scale) towards it, weighted by distance and by ONLINE_RATE, as a ratio to what
the table predicted (so an observation at b=20 corrects the b=16 curve by how wrong the table
was at b=20, not by the raw time of a larger batch).
"""

from __future__ import annotations

import bisect
import logging
import math
import time

import numpy as np

logger = logging.getLogger(__name__)

ONLINE_RATE = 0.05     # weight of one observed step in its table point


class StepCostModel:
    def __init__(self, table: dict[int, list[tuple[float, float]]]) -> None:
        """table: batch size -> [(drafts per sequence, seconds)], at least one point each."""
        if not table or any(not points for points in table.values()):
            raise ValueError("the step-cost table needs at least one batch size with one point")
        self.batch_sizes = sorted(table)
        self._raw = {b: dict(table[b]) for b in self.batch_sizes}
        self._smooth()

    def _smooth(self) -> None:
        # Timings on a shared machine are noisy; a step never gets cheaper with more drafts or
        # more sequences, so each curve is made non-decreasing, and so is each point over b.
        self.curves: dict[int, list[tuple[float, float]]] = {}
        previous: dict[float, float] = {}
        for b in self.batch_sizes:
            curve, floor = [], 0.0
            for e, seconds in sorted(self._raw[b].items()):
                floor = max(floor, seconds, previous.get(e, 0.0))
                curve.append((e, floor))
                previous[e] = floor
            self.curves[b] = curve
        # The curves' x values apart: cost() runs a few hundred times a step at batch 64.
        self._xs = {b: [e for e, _ in curve] for b, curve in self.curves.items()}

    def cost(self, num_seqs: int, num_tokens: int) -> float:
        """Seconds for a step of num_seqs sequences and num_tokens query tokens in all."""
        num_seqs = max(num_seqs, 1)
        per_seq = max(num_tokens / num_seqs - 1.0, 0.0)
        sizes = self.batch_sizes
        if num_seqs >= sizes[-1]:
            return _interp(self.curves[sizes[-1]], self._xs[sizes[-1]], per_seq) * num_seqs / sizes[-1]
        if num_seqs <= sizes[0]:
            return _interp(self.curves[sizes[0]], self._xs[sizes[0]], per_seq)
        hi = bisect.bisect_left(sizes, num_seqs)
        b0, b1 = sizes[hi - 1], sizes[hi]
        c0, c1 = _interp(self.curves[b0], self._xs[b0], per_seq), _interp(self.curves[b1], self._xs[b1], per_seq)
        return c0 + (c1 - c0) * (num_seqs - b0) / (b1 - b0)

    def costs(self, num_seqs: int, num_tokens: np.ndarray) -> np.ndarray:
        """`cost` at many token counts of one batch size at once (the adaptive policy weighs a
        few hundred a step at batch 64)."""
        num_seqs = max(num_seqs, 1)
        per_seq = np.maximum(np.asarray(num_tokens, dtype=np.float64) / num_seqs - 1.0, 0.0)
        sizes = self.batch_sizes
        if num_seqs >= sizes[-1]:
            return _interp_many(self.curves[sizes[-1]], per_seq) * num_seqs / sizes[-1]
        if num_seqs <= sizes[0]:
            return _interp_many(self.curves[sizes[0]], per_seq)
        hi = bisect.bisect_left(sizes, num_seqs)
        b0, b1 = sizes[hi - 1], sizes[hi]
        c0, c1 = _interp_many(self.curves[b0], per_seq), _interp_many(self.curves[b1], per_seq)
        return c0 + (c1 - c0) * (num_seqs - b0) / (b1 - b0)

    def observe(self, num_seqs: int, num_tokens: int, seconds: float) -> None:
        """Fold one measured decode-shaped step into the nearest table point."""
        predicted = self.cost(num_seqs, num_tokens)
        if predicted <= 0 or seconds <= 0:
            return
        b = min(self.batch_sizes, key=lambda size: abs(math.log(size) - math.log(max(num_seqs, 1))))
        per_seq = max(num_tokens / max(num_seqs, 1) - 1.0, 0.0)
        points = sorted(self._raw[b])
        hi = min(max(bisect.bisect_left(points, per_seq), 1), len(points) - 1) if len(points) > 1 else 0
        lo = max(hi - 1, 0)
        span = points[hi] - points[lo]
        w_hi = 1.0 if span == 0 else min(max((per_seq - points[lo]) / span, 0.0), 1.0)
        for e, weight in ((points[lo], 1.0 - w_hi), (points[hi], w_hi)):
            if weight > 0:
                self._raw[b][e] *= 1.0 + ONLINE_RATE * weight * (seconds / predicted - 1.0)
        self._smooth()

    def describe(self) -> str:
        return "; ".join(f"b={b}: " + ", ".join(f"e={e:g} {1e3 * s:.2f} ms" for e, s in self.curves[b])
                         for b in self.batch_sizes)


def _interp(points: list[tuple[float, float]], xs: list[float], x: float) -> float:
    """Piecewise-linear through the points (xs: their x values), extended linearly past the last
    (flat if one point)."""
    if len(points) == 1:
        return points[0][1]
    i = min(max(bisect.bisect_right(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0) if x1 != x0 else y1


def _interp_many(points: list[tuple[float, float]], x: np.ndarray) -> np.ndarray:
    """_interp at every x (the same segments, the same extension past the last point)."""
    if len(points) == 1:
        return np.full(x.shape, points[0][1])
    xs = np.array([p[0] for p in points])
    ys = np.array([p[1] for p in points])
    i = np.clip(np.searchsorted(xs, x, side="right"), 1, len(points) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    span = np.where(x1 != x0, x1 - x0, 1.0)
    return np.where(x1 != x0, np.maximum(y0 + (y1 - y0) * (x - x0) / span, 0.0), y1)


def profile_step_cost(time_forward, k: int, max_num_seqs: int, max_num_batched_tokens: int,
                      batch_sizes: tuple[int, ...] = (1, 4, 16, 64), repeats: int = 3) -> StepCostModel:
    """time_forward(b, q) runs one forward of b sequences of q query tokens and returns seconds.

    Every shape runs once to warm up, then the shapes take turns `repeats` times and each keeps
    its fastest run (the least disturbed by whatever else the machine does).
    """
    draft_counts = sorted({0, max(k // 2, 1), k})
    shapes = [(b, e) for b in batch_sizes if b <= max_num_seqs
              for e in draft_counts if b * (1 + e) <= max_num_batched_tokens]
    if not shapes:
        shapes = [(1, 0)]
    start = time.perf_counter()
    best = {shape: float("inf") for shape in shapes}
    for shape in shapes:
        time_forward(shape[0], 1 + shape[1])
    for _ in range(repeats):
        for shape in shapes:
            best[shape] = min(best[shape], time_forward(shape[0], 1 + shape[1]))
    table: dict[int, list[tuple[float, float]]] = {}
    for (b, e), seconds in best.items():
        table.setdefault(b, []).append((float(e), seconds))
    model = StepCostModel(table)
    logger.info("speculative decoding step-cost profile (%.1f s): %s", time.perf_counter() - start,
                model.describe())
    return model
