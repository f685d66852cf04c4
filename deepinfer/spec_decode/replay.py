"""A drafter that replays recorded continuations at a set acceptance rate.

It measures the verification machinery, not a drafter: how fast can the engine go when drafts
survive with probability alpha? A first run without speculation records each prompt's greedy
continuation; this drafter then proposes, for a request with that prompt, the next recorded
tokens, each one kept with probability alpha and otherwise replaced by a different token.
Under greedy verification a kept token is accepted exactly when the request still follows the
recording, so the chance that a draft survives given the ones before it did is alpha at every
position, and a step verifying k drafts accepts alpha + ... + alpha^k of them on average.

Which output positions are changed, and to what, is drawn once per recording when the file is
read (seeded): a rejected draft's position is never proposed again (the target's token takes
it), so each position is still kept with probability alpha, and two runs of the same recording
(fixed and adaptive verification, say, or two batch sizes) meet the same drafts.

The recording is a JSON-lines file, one object a prompt:
    {"prompt_token_ids": [...], "output_token_ids": [...], "acceptance": 0.7}
A request whose tokens leave the recording (a greedy tie broken otherwise by another batch
shape, say) gets no more drafts: the recording no longer says what follows. The count of such
requests is `num_diverged`.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.types.drafter import Draft, Drafter, DraftRequest

logger = logging.getLogger(__name__)


@dataclass
class Recording:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    acceptance: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"a replay recording's acceptance must be in [0, 1], got {self.acceptance!r}")
        if not self.prompt_token_ids:
            raise ValueError("a replay recording needs a non-empty prompt_token_ids")


@dataclass
class _Drafts:
    """A recording's drafts by output position: the recorded token, or the one it was changed to."""

    recording: Recording
    token_ids: list[int]


@dataclass
class _Follow:
    """A live request matched to its recording; `checked`: output tokens found equal so far."""

    drafts: _Drafts | None     # None: no recording for this prompt, or the request left it
    checked: int = 0


class ReplayDrafter(Drafter):
    name = "replay"

    def __init__(self, recordings: Sequence[Recording], vocab_size: int, seed: int = 0) -> None:
        if vocab_size < 2:
            raise ValueError("a replay drafter needs a vocabulary of at least 2 tokens")
        self._by_prompt = {tuple(r.prompt_token_ids): _Drafts(r, _changed(r, vocab_size, seed * 1_000_003 + i))
                           for i, r in enumerate(recordings)}
        self._prompt_lengths = sorted({len(r.prompt_token_ids) for r in recordings})
        self._follows: dict[str, _Follow] = {}
        self.num_diverged = 0

    @classmethod
    def load(cls, path: str, vocab_size: int, seed: int = 0) -> ReplayDrafter:
        recordings = []
        try:
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            recordings.append(Recording(**json.loads(line)))
                        except (TypeError, ValueError) as e:
                            raise ValueError(f"speculative_config.replay_path {path!r} line {number}: {e}") from None
        except OSError as e:
            raise ValueError(f"speculative_config.replay_path {path!r} cannot be read: {e}") from None
        if not recordings:
            raise ValueError(f"speculative_config.replay_path {path!r} holds no recording")
        return cls(recordings, vocab_size, seed)

    def recording_for(self, token_ids: Sequence[int]) -> _Drafts | None:
        """The recording whose prompt the tokens start with (the longest such), or None."""
        found = None
        for length in self._prompt_lengths:   # the request's prompt is one of these long
            if length < len(token_ids):
                found = self._by_prompt.get(tuple(token_ids[:length])) or found
        return found

    def _follow(self, request: DraftRequest) -> _Follow:
        follow = self._follows.get(request.request_id)
        if follow is None:
            follow = self._follows[request.request_id] = _Follow(self.recording_for(request.token_ids))
        return follow

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        out = {}
        for request in requests:
            follow = self._follow(request)
            if follow.drafts is None:
                continue
            recording = follow.drafts.recording
            tokens, recorded = request.token_ids, recording.output_token_ids
            done = len(tokens) - len(recording.prompt_token_ids)   # output tokens so far
            # Only the tokens added since the last look are compared: O(new tokens) a step.
            if done > len(recorded) or list(tokens[len(tokens) - done + follow.checked:]) != recorded[follow.checked:done]:
                follow.drafts = None
                self.num_diverged += 1
                logger.debug("replay: request %s left its recording after %d output tokens", request.request_id, done)
                continue
            follow.checked = done
            drafts = follow.drafts.token_ids[done:done + request.max_drafts]
            if drafts:
                out[request.request_id] = Draft(drafts, [recording.acceptance] * len(drafts))
        return out

    def release(self, live_request_ids: set[str]) -> None:
        for request_id in [r for r in self._follows if r not in live_request_ids]:
            del self._follows[request_id]


def _changed(recording: Recording, vocab_size: int, seed: int) -> list[int]:
    """The recording's output with each token kept with probability `acceptance`, else replaced
    by another token of the vocabulary."""
    rng = random.Random(seed)
    return [t if rng.random() < recording.acceptance else (t + 1 + rng.randrange(vocab_size - 1)) % vocab_size
            for t in recording.output_token_ids]
