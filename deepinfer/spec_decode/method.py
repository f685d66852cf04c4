"""The speculative method and verification mode, resolved once from `speculative_config`.

config.py parses and checks the strings (`method`, `verification`); this module turns them into
one object that the engine core, the scheduler and the model runner ask questions of ("does this
method draft on the device?", "does verification estimate survival?"), so no layer compares a
method or mode string where it uses it. It imports nothing of deepinfer but the config, so both
roles (the scheduler's side in spec_decode/, the worker's in worker/spec/) can read it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from deepinfer.config import SpeculativeConfig


class DraftSource(enum.Enum):
    """Where a method's drafts come from."""

    NGRAM = "ngram"              # prompt lookup in the request's own tokens (model-free)
    DRAFT_MODEL = "draft_model"  # a second, smaller model sharing the tokenizer
    MTP = "mtp"                  # the target model's own multi-token-prediction head
    REPLAY = "replay"            # a recorded continuation at a set acceptance (measurement)


# Sources whose drafting a verify chain can repeat on the device between its steps
# (worker/spec/verify_chain.py): a lookup in tokens the device already holds.
_DEVICE_DRAFTING = frozenset({DraftSource.NGRAM, DraftSource.REPLAY})


@dataclass(frozen=True)
class SpeculativeMethod:
    """What the engine's layers need to know of the configured speculation."""

    config: SpeculativeConfig
    source: DraftSource
    # Adaptive verification: each step admits the draft positions whose expected accepted
    # tokens per second of step cost pay (spec_decode/policy.py); else every draft, up to k.
    adaptive: bool

    @classmethod
    def resolve(cls, config: SpeculativeConfig | None) -> SpeculativeMethod | None:
        """None when speculation is off."""
        if config is None:
            return None
        return cls(config, DraftSource(config.method), config.verification == "adaptive")

    @property
    def k(self) -> int:
        """Drafts proposed per request and step."""
        return self.config.num_speculative_tokens

    @property
    def has_draft_model(self) -> bool:
        """A second model runs beside the target: its weights and KV share the target's budget."""
        return self.source is DraftSource.DRAFT_MODEL

    @property
    def drafts_on_device(self) -> bool:
        """Its drafting can be repeated on the device inside a verify chain."""
        return self.source in _DEVICE_DRAFTING

    @property
    def chains(self) -> bool:
        """Plans may run several verify steps back to back (verify_chain > 1; config.py allows it
        only for methods that draft on the device)."""
        return self.config.verify_chain > 1

    @property
    def reads_target_state(self) -> bool:
        """Its drafts read what the target's last forward kept per request (an MTP head reads the
        hidden states), so they cannot be proposed while a later step is already queued."""
        return self.source is DraftSource.MTP

    @property
    def chooses_loop(self) -> bool:
        """Under overlapped scheduling, each step may pick between verifying drafts and a plain
        overlapped step (spec_decode/overlap.py). Fixed verification is the user asking for every
        draft to be verified, and MTP drafts need the step before collected (reads_target_state):
        both speculate at every step."""
        return self.adaptive and not self.reads_target_state
