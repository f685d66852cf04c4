"""Speculative-decoding counters kept in the engine core (cumulative, like vLLM's).

num_drafts:           verifications (one request, one step, at least one draft verified)
num_draft_tokens:     draft tokens verified
num_accepted_tokens:  draft tokens accepted
verified_per_pos[j]:  verifications that reached position j (had more than j drafts)
accepted_per_pos[j]:  of those, accepted at position j
num_proposed_tokens:  draft tokens the drafter proposed (adaptive verification verifies fewer)

Mean accepted length counts the target's own token too: 1 + accepted / drafts (vLLM's figure).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_proposed_tokens: int = 0
    verified_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.verified_per_pos = self.verified_per_pos or [0] * k
        self.accepted_per_pos = self.accepted_per_pos or [0] * k

    def record(self, num_verified: int, num_accepted: int) -> None:
        if num_verified <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_verified
        self.num_accepted_tokens += num_accepted
        for j in range(min(num_verified, len(self.verified_per_pos))):
            self.verified_per_pos[j] += 1
            self.accepted_per_pos[j] += j < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """P(accepted at j | verified at j): the conditional rate, meaningful for variable lengths."""
        return [a / v if v else 0.0 for a, v in zip(self.accepted_per_pos, self.verified_per_pos)]

    def summary(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.acceptance_rate_per_pos)
        return (f"mean accepted length {self.mean_accepted_length:.2f}, acceptance {self.acceptance_rate:.2f}, "
                f"verified {self.num_draft_tokens} / accepted {self.num_accepted_tokens} draft tokens "
                f"(proposed {self.num_proposed_tokens}), per position [{rates}]")

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_speculative_tokens, self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, self.num_proposed_tokens,
                               list(self.verified_per_pos), list(self.accepted_per_pos))
