"""Online calibration of drafter confidence against observed acceptance.

A drafter's confidence is a ranking, not a probability (an n-gram match length, a small model's
softmax). What the scheduler needs is the conditional acceptance probability of position j
given that positions < j were accepted. This table learns it: cells keyed by (position,
confidence bucket) keep a decayed running mean of "was the draft at this position accepted",
counting only positions that were actually reached:

    drafts d_1..d_m verified, a accepted -> positions 1..a are successes, position a+1 (if
    a < m) is a failure, positions beyond a+1 were never put to the test and teach nothing.

Until a cell has evidence a prior worth PRIOR_WEIGHT observations stands in for it: the raw
confidence at position 0, the previous position's estimate for the same bucket after that. A
fresh engine trusts the drafter and then corrects it. The decay lets the
estimate follow a workload that changes (a chat turns into a copy task).
"""

from __future__ import annotations

PRIOR_WEIGHT = 4.0
DECAY = 0.998          # per observation of a cell: its evidence halves after ~350 updates


class AcceptanceCalibrator:
    def __init__(self, num_positions: int, num_buckets: int = 10) -> None:
        if num_positions < 1 or num_buckets < 1:
            raise ValueError("the calibrator needs at least one position and one bucket")
        self.num_positions = num_positions
        self.num_buckets = num_buckets
        self._accepted = [[0.0] * num_buckets for _ in range(num_positions)]
        self._trials = [[0.0] * num_buckets for _ in range(num_positions)]
        # estimate(p, c) = offset[p][b] + scale[p][b] * c for c's bucket b (the chain below is
        # affine in the raw confidence it starts from); rebuilt after observations, so a step's
        # many estimates cost a lookup each rather than a walk down the positions.
        self._affine: tuple[list[list[float]], list[list[float]]] | None = None

    def _bucket(self, confidence: float) -> int:
        return min(max(int(confidence * self.num_buckets), 0), self.num_buckets - 1)

    def estimate(self, position: int, confidence: float) -> float:
        """P(draft at `position` (0-based) accepted | all before it accepted).

        The prior of a cell is the estimate of the same bucket one position earlier (the raw
        confidence at position 0). Without that chain a position the policy never admits would
        never be observed, and a pessimistic first guess there would never be corrected.
        """
        if self._affine is None:
            self._affine = self._chains()
        offset, scale = self._affine
        b, p = self._bucket(confidence), min(position, self.num_positions - 1)
        return offset[p][b] + scale[p][b] * min(max(confidence, 0.0), 1.0)

    def _chains(self) -> tuple[list[list[float]], list[list[float]]]:
        """Per position and bucket, the chain value = (accepted + W value) / (trials + W) from
        position 0 to there, as offset + scale * (the starting value)."""
        offset = [[0.0] * self.num_buckets for _ in range(self.num_positions)]
        scale = [[0.0] * self.num_buckets for _ in range(self.num_positions)]
        for b in range(self.num_buckets):
            a, s = 0.0, 1.0
            for p in range(self.num_positions):
                denominator = self._trials[p][b] + PRIOR_WEIGHT
                a = (self._accepted[p][b] + PRIOR_WEIGHT * a) / denominator
                s = PRIOR_WEIGHT * s / denominator
                offset[p][b], scale[p][b] = a, s
        return offset, scale

    def evidence(self, position: int, confidence: float) -> float:
        """How many (decayed) observations the cell holds."""
        return self._trials[min(position, self.num_positions - 1)][self._bucket(confidence)]

    def survival(self, confidences: list[float]) -> list[float]:
        """q_j = P(drafts 1..j all accepted): the running product of calibrated estimates."""
        out, q = [], 1.0
        for position, confidence in enumerate(confidences):
            q *= self.estimate(position, confidence)
            out.append(q)
        return out

    def observe(self, confidences: list[float], num_accepted: int) -> None:
        """`confidences` of the drafts that were verified, of which the first num_accepted passed."""
        self._affine = None
        reached = min(len(confidences), num_accepted + 1)
        for position in range(min(reached, self.num_positions)):
            b = self._bucket(confidences[position])
            self._accepted[position][b] = self._accepted[position][b] * DECAY + (position < num_accepted)
            self._trials[position][b] = self._trials[position][b] * DECAY + 1.0
