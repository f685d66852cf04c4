"""A draft model: a second (smaller) model sharing the target's tokenizer proposes the drafts.

It runs on deepinfer's own pieces: a ModelRunner of its own (weights, KV tensors) and a
KVCacheManager of its own over that runner's blocks (no prefix caching: draft KV is cheap to
recompute and short-lived). Per request it remembers how many leading tokens its KV holds
correctly (`num_computed`). A proposal round for a batch is k forwards of the draft model:

    forward 1: each request's tokens the draft has not seen yet (the tokens accepted since the
               last round, or its whole prompt the first time) -> argmax = draft 1
    forward j: draft j-1 alone -> argmax = draft j          (requests that want fewer drop out)

Drafts are argmax tokens, so the draft distribution is a point mass (see verifier.py), and each
draft's confidence is the draft model's own probability of it.

After verification, the draft KV of accepted drafts is still valid (same tokens at the same
positions); `_sync` counts how many of its last drafts the target accepted and keeps those.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer.config import CacheConfig, EngineConfig, ModelConfig
from deepinfer.engine.plan import NewRequestData, ScheduledChunk, SchedulerPlan
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec_decode.drafter import Draft, Drafter, DraftRequest

logger = logging.getLogger(__name__)

# Argmax tokens plus the logprob of each (its confidence); nothing else is computed.
_DRAFT_PARAMS = SamplingParams(temperature=0.0, logprobs=0)


@dataclass
class _DraftSeq:
    """The draft model's view of one request (duck-types what KVCacheManager reads)."""

    request_id: str
    num_computed_tokens: int = 0          # leading tokens whose draft KV is valid
    num_real_tokens: int = 0              # tokens of the request seen at the last round
    last_drafts: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    num_published_blocks: int = 0


class DraftModelDrafter(Drafter):
    name = "draft_model"

    def __init__(self, draft_path: str, target_config: EngineConfig, target_tokenizer, target_vocab_size: int,
                 num_blocks: int, platform, num_speculative_tokens: int) -> None:
        from deepinfer.models.loader import load_model_source
        from deepinfer.worker.model_runner import ModelRunner

        source = load_model_source(draft_path)
        _check_same_tokenizer(source, target_tokenizer, target_vocab_size, draft_path)
        config = EngineConfig(
            # Eager: drafting steps vary in shape, and graphs would take memory the target's KV
            # budget did not leave (the target sizes its pool before the draft model loads).
            ModelConfig(model=draft_path, dtype=target_config.model.dtype,
                        quantization=target_config.model.quantization, enforce_eager=True),
            # As many blocks as the target has: the draft never holds more tokens than it does.
            CacheConfig(block_size=target_config.cache.block_size, num_kv_blocks=num_blocks,
                        enable_prefix_caching=False),
            # The target's batch limits: the draft computes the same steps' tokens.
            target_config.scheduler)
        self.runner = ModelRunner(config, source.hf_config, platform, source)
        self.kv = KVCacheManager(self.runner.groups, self.runner.num_blocks, config.cache.block_size,
                                 enable_prefix_caching=False)
        self.eos = frozenset(target_tokenizer.eos_token_ids)
        self.k = num_speculative_tokens
        self.seqs: dict[str, _DraftSeq] = {}
        self._dropped: list[str] = []      # tell the draft runner to forget these next round

    def release(self, live_request_ids: set[str]) -> None:
        for request_id in [r for r in self.seqs if r not in live_request_ids]:
            self.kv.free(self.seqs.pop(request_id))
            self._dropped.append(request_id)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        active: list[tuple[DraftRequest, _DraftSeq]] = []
        new_requests = []
        for request in requests:
            seq = self.seqs.get(request.request_id)
            if seq is None:
                seq = self.seqs[request.request_id] = _DraftSeq(request.request_id)
            self._sync(seq, request.token_ids)
            want = min(self.k, request.max_drafts)
            # Room for the unseen tokens plus want - 1 drafts fed back (the last is never fed).
            if want <= 0 or not self.kv.allocate(seq, len(request.token_ids) - seq.num_computed_tokens + want - 1):
                continue
            active.append((request, seq))
            # The runner keeps its own copy of the token ids; re-register the request each
            # round with the current ones (a list copy, far cheaper than the forwards).
            self._dropped.append(request.request_id)
            new_requests.append(NewRequestData(request.request_id, list(request.token_ids), [], _DRAFT_PARAMS,
                                               self.eos))
        drafts = {request.request_id: Draft() for request, _ in active}
        for step in range(self.k):
            chunks = []
            for request, seq in active:
                if step >= min(self.k, request.max_drafts):
                    continue
                start = seq.num_computed_tokens
                total = len(request.token_ids) + step   # tokens known to the draft runner now
                chunks.append(ScheduledChunk(request.request_id, start, total - start,
                                             [list(ids) for ids in seq.block_ids], sample=True))
                seq.num_computed_tokens = total
            if not chunks:
                break
            plan = SchedulerPlan(new_requests, chunks, self._dropped, sum(c.num_tokens for c in chunks))
            new_requests, self._dropped = [], []
            result = self.runner.execute(plan)
            for chunk in chunks:
                token = result.sampled_token_ids[chunk.request_id][0]
                logprob = result.logprobs[chunk.request_id][0][token].logprob
                draft = drafts[chunk.request_id]
                draft.token_ids.append(token)
                draft.confidences.append(math.exp(logprob))
        for request, seq in active:
            seq.num_real_tokens = len(request.token_ids)
            seq.last_drafts = drafts[request.request_id].token_ids
        return drafts

    def _sync(self, seq: _DraftSeq, token_ids: Sequence[int]) -> None:
        """Keep the draft KV of drafts the target accepted; forget the rest."""
        if seq.num_computed_tokens > seq.num_real_tokens:
            base = seq.num_real_tokens
            kept = 0
            # Draft i sits at position base + i; its KV was computed iff it was fed back.
            while (kept < len(seq.last_drafts) - 1 and base + kept < len(token_ids)
                   and token_ids[base + kept] == seq.last_drafts[kept]):
                kept += 1
            seq.num_computed_tokens = min(seq.num_computed_tokens, base + kept)
        # A preempted-and-resumed request can come back shorter than we last saw it.
        seq.num_computed_tokens = min(seq.num_computed_tokens, max(len(token_ids) - 1, 0))
        seq.num_real_tokens = len(token_ids)


def _check_same_tokenizer(source, target_tokenizer, target_vocab_size: int, path: str) -> None:
    draft_vocab = source.hf_config.get("vocab_size")
    same = (source.tokenizer.backend.get_vocab(with_added_tokens=True)
            == target_tokenizer.backend.get_vocab(with_added_tokens=True))
    if not same:
        raise ValueError(f"speculative_config.model {path!r} does not share the target's tokenizer "
                         "(its vocabulary differs); a draft model must use the same token ids")
    if draft_vocab is not None and draft_vocab < target_tokenizer.vocab_size:
        raise ValueError(f"speculative_config.model {path!r} has vocab_size {draft_vocab}, smaller than the "
                         f"tokenizer's {target_tokenizer.vocab_size}")
    del target_vocab_size  # logits rows may be padded past the tokenizer; only the ids must agree
