"""The hook for a model's own multi-token-prediction head (DeepSeek-V4's MTP / DSpark drafter).

A model that carries such a head exposes `propose_mtp(requests) -> {request_id: Draft}` (it
runs the head on the hidden states of its last forward and returns drafts with the head's own
confidences); the executor runs it where the model lives (Executor.propose_mtp). DeepSeek-V4
checkpoints with MTP layers have one (models/deepseek_v4/mtp_drafter.py); for any other model,
building this drafter fails at start-up with a message that says so, instead of silently
decoding without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer.types.drafter import Draft, Drafter, DraftRequest

if TYPE_CHECKING:
    from deepinfer.executor import Executor


class MTPDrafter(Drafter):
    name = "mtp"

    def __init__(self, executor: Executor, hf_config: dict, num_speculative_tokens: int) -> None:
        if not executor.supports_mtp():
            architecture = ", ".join(hf_config.get("architectures") or ["the model"])
            raise ValueError(
                f"speculative_config.method 'mtp' is not available for this model: "
                f"{architecture} has no multi-token-prediction head "
                "(use method 'ngram', or 'draft_model' with a smaller model sharing the tokenizer)")
        self.executor = executor
        self.k = num_speculative_tokens

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        return self.executor.propose_mtp(requests)
