"""Which draft positions to verify this step: fixed length, or chosen by expected acceptance.

Both rules share the scheduler's token budget: a verified draft costs one token of the step
like any prompt token, and drafts come out of what is left after every running request's own
token (so speculation never starves a running request, and waiting prompts get the rest).

fixed:    every request verifies its whole draft (up to k), in running order, while budget lasts.
adaptive: slot (r, j) = "verify draft j of request r" is worth q_rj, the probability that drafts
          1..j of r all survive (calibration.py), i.e. its expected contribution of accepted
          tokens. Slots are taken in order of q (never j before j-1: q falls along a chain, ties
          go to the smaller j). Taking p slots gives an expected E(p) = n + sum of the first p
          q's tokens (n: one sure token per generating request) for a step that costs
          C(T0 + p) seconds (cost_model.py). We take the p that maximises E(p) / C(T0 + p),
          the step's expected tokens per second. Each slot in that prefix is one whose marginal
          expected tokens per marginal second beat the step's average, which is the greedy rule
          "admit by marginal expected accepted tokens per unit marginal cost" made exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class Candidate:
    request_id: str
    survival: list[float]     # q_1 >= q_2 >= ...: P(the first j drafts all accepted) (adaptive)
    num_drafts: int = -1      # drafts proposed (fixed reads only this); -1: len(survival)

    def __post_init__(self) -> None:
        if self.num_drafts < 0:
            self.num_drafts = len(self.survival)


def admit_fixed(candidates: list[Candidate], budget: int) -> dict[str, int]:
    out = {}
    for c in candidates:
        n = min(c.num_drafts, budget)
        if n <= 0:
            break
        out[c.request_id] = n
        budget -= n
    return out


def admit_adaptive(candidates: list[Candidate], budget: int, num_generating: int, base_tokens: int,
                   step_costs: Callable[[np.ndarray], np.ndarray]) -> dict[str, int]:
    """step_costs(num_tokens) -> seconds for this step's batch at each of the query token counts
    (an array; StepCostModel.costs). Every prefix is weighed at once, in numpy: a few hundred
    slots at batch 64."""
    slots = sorted(((q, j, c.request_id) for c in candidates for j, q in enumerate(c.survival)),
                   key=lambda s: (-s[0], s[1]))
    slots = slots[:max(budget, 0)]
    # expected[p] = num_generating + the first p slots' q; the first best rate wins (p = 0 on ties).
    expected = num_generating + np.concatenate([[0.0], np.cumsum([q for q, _, _ in slots])])
    seconds = np.broadcast_to(step_costs(base_tokens + np.arange(len(slots) + 1)), expected.shape)
    best_p = int(np.argmax(expected / np.maximum(seconds, 1e-12)))
    out: dict[str, int] = {}
    for _, j, request_id in slots[:best_p]:
        out[request_id] = max(out.get(request_id, 0), j + 1)
    return out
