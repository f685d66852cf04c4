"""N-gram prompt lookup: model-free drafts copied from earlier in the sequence.

For the last n tokens (n from prompt_lookup_max down to prompt_lookup_min), find their most
recent earlier occurrence in prompt + output and propose the tokens that followed it. This is
what makes editing, quoting and code-refactoring workloads fast: the answer repeats spans of
the prompt.

Confidence: how long the match really is. The n-gram is extended backwards as far as the two
spans agree (up to MAX_MATCH tokens); a long match means the output is copying, a 1-token match
is close to a guess. Later positions are discounted (each further copied token can diverge).
The numbers are only a ranking; calibration.py learns what they mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deepinfer.types.drafter import Draft, Drafter, DraftRequest

MAX_MATCH = 32          # backward extension cap: beyond this every match looks alike
POSITION_DISCOUNT = 0.9


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.k = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        drafts = {}
        for request in requests:
            draft = self.lookup(request.token_ids, min(self.k, request.max_drafts))
            if draft.token_ids:
                drafts[request.request_id] = draft
        return drafts

    def lookup(self, token_ids: Sequence[int], k: int) -> Draft:
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return Draft()
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # Windows starting at 0 .. length-n-1: every earlier occurrence, never the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if not len(hits):
                continue
            start = int(hits[-1])          # most recent occurrence: the likeliest to be copied now
            follow = tokens[start + n:start + n + k]
            match = n + _backward_match(tokens, start - 1, length - n - 1, MAX_MATCH - n)
            base = match / (match + 1.0)
            return Draft(follow.tolist(), [base * POSITION_DISCOUNT ** j for j in range(len(follow))])
        return Draft()


def _backward_match(tokens: np.ndarray, i: int, j: int, limit: int) -> int:
    """How many tokens agree going backwards from positions i and j (i < j), up to limit."""
    count = 0
    while count < limit and i >= 0 and tokens[i] == tokens[j]:
        count, i, j = count + 1, i - 1, j - 1
    return count
