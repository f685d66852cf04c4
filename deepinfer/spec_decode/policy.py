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


@dataclass
class Candidate:
    request_id: str
    survival: list[float]     # q_1 >= q_2 >= ...: P(the first j drafts all accepted)


def admit_fixed(candidates: list[Candidate], budget: int) -> dict[str, int]:
    out = {}
    for c in candidates:
        n = min(len(c.survival), budget)
        if n <= 0:
            break
        out[c.request_id] = n
        budget -= n
    return out


def admit_adaptive(candidates: list[Candidate], budget: int, num_generating: int, base_tokens: int,
                   step_cost: Callable[[int], float]) -> dict[str, int]:
    """step_cost(num_tokens) -> seconds for this step's batch with num_tokens query tokens."""
    slots = sorted(((q, j, c.request_id) for c in candidates for j, q in enumerate(c.survival)),
                   key=lambda s: (-s[0], s[1]))
    slots = slots[:max(budget, 0)]
    expected = float(num_generating)
    best_p, best_rate = 0, expected / max(step_cost(base_tokens), 1e-12)
    for p, (q, _, _) in enumerate(slots, start=1):
        expected += q
        rate = expected / max(step_cost(base_tokens + p), 1e-12)
        if rate > best_rate:
            best_p, best_rate = p, rate
    out: dict[str, int] = {}
    for _, j, request_id in slots[:best_p]:
        out[request_id] = max(out.get(request_id, 0), j + 1)
    return out
