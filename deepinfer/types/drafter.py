"""The drafter interface: up to k draft tokens per request, each with a confidence.

A drafter sees the requests that are about to generate (every known token computed except the
last sampled one) and proposes, per request, a chain of draft tokens that would follow. Each
draft carries a confidence in [0, 1] per position: the drafter's own guess that the draft at
that position survives verification given that the ones before it did. The guesses need not be
calibrated; `calibration.py` maps them to observed acceptance rates online.

Every drafter here proposes deterministically (n-gram lookup, a draft model's argmax), so the
draft distribution is a point mass; the verifier relies on that for lossless sampling.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class DraftRequest:
    """What a drafter is told about one request."""

    request_id: str
    token_ids: Sequence[int]      # prompt + accepted output, in order (never copied by the caller)
    max_drafts: int               # propose at most this many (k, capped by max_tokens / max_model_len)


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)   # one per token, in [0, 1]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.confidences):
            raise ValueError(f"a draft has {len(self.token_ids)} tokens but "
                             f"{len(self.confidences)} confidences")


class Drafter(ABC):
    name: str = "drafter"

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        """Drafts for some or all of `requests` (a request left out, or with an empty draft,
        simply generates one token this step)."""

    def release(self, live_request_ids: set[str]) -> None:
        """Forget state of every request not in `live_request_ids` (finished or preempted)."""
