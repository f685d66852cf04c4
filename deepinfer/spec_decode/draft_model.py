"""A draft model: a second (smaller) model sharing the target's tokenizer proposes the drafts.

It runs on deepinfer's own pieces: an executor of its own, built by the same factory as the
target's (executor/factory.py, make_executor: its model runner, weights and KV tensors), and a
KVCacheManager of its own over that runner's blocks (no prefix caching: draft KV is cheap to recompute and
short-lived). It talks to its runner in plans, as the scheduler talks to the target's: a
request comes whole the first time (NewRequestData), then as diffs (CachedRequestData: new
block ids, and the tokens the target accepted in place of the runner's own drafts).

Per request it remembers how many leading tokens its KV holds correctly (`num_computed_tokens`)
and what its runner's token list holds (the request's tokens up to `num_runner_real`, then the
drafts it sampled last). A proposal round for a batch is k forwards of the draft model:

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

from deepinfer.config import DEFAULT_MAX_GRAPH_ROWS, CacheConfig, EngineConfig, ModelConfig
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.sampling_params import SamplingParams
from deepinfer.types.block_tables import RunnerBlockTables
from deepinfer.types.drafter import Draft, Drafter, DraftRequest
from deepinfer.types.plan import CachedRequestData, NewRequestData, ScheduledChunk, SchedulerPlan

logger = logging.getLogger(__name__)

# Argmax tokens plus the logprob of each (its confidence); nothing else is computed.
_DRAFT_PARAMS = SamplingParams(temperature=0.0, logprobs=0)


@dataclass
class _DraftSeq:
    """The draft model's view of one request (duck-types what KVCacheManager reads)."""

    request_id: str
    num_computed_tokens: int = 0          # leading tokens whose draft KV is valid
    # The draft runner's token list: the request's first `num_runner_real` tokens, then
    # `runner_drafts` (what it sampled in the last round it took part in).
    num_runner_real: int = 0
    runner_drafts: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    num_published_blocks: int = 0


class DraftModelDrafter(Drafter):
    name = "draft_model"

    def __init__(self, draft_path: str, target_config: EngineConfig, target_tokenizer, target_vocab_size: int,
                 num_blocks: int, num_speculative_tokens: int, load_weights: bool = True) -> None:
        """load_weights=False keeps random draft weights, as the target's load_format="dummy"."""
        from deepinfer.executor import make_executor
        from deepinfer.models.loader import load_model_source

        source = load_model_source(draft_path)
        _check_same_tokenizer(source, target_tokenizer, target_vocab_size, draft_path)
        spec = target_config.speculative
        eager = target_config.model.enforce_eager if spec is None or spec.enforce_eager is None else spec.enforce_eager
        config = EngineConfig(
            # Its decode steps replay CUDA graphs as the target's do: the first forward of a
            # round (the tokens the target accepted, up to 1 + k a request) as decode rows
            # (input_batch.fits_decode_rows), hence graphs of up to 1 + k rows a request; the
            # later ones are one row a request.
            ModelConfig(model=draft_path, dtype=target_config.model.dtype,
                        quantization=target_config.model.quantization, enforce_eager=eager,
                        max_cudagraph_capture_size=min(target_config.scheduler.max_num_seqs
                                                       * (num_speculative_tokens + 1), DEFAULT_MAX_GRAPH_ROWS)),
            # As many blocks as the target has: the draft never holds more tokens than it does.
            CacheConfig(block_size=target_config.cache.block_size, num_kv_blocks=num_blocks,
                        enable_prefix_caching=False),
            # The target's batch limits: the draft computes the same steps' tokens.
            target_config.scheduler,
            target_config.parallel)
        self.executor = make_executor(config, source, load_weights=load_weights)
        kv = self.executor.kv_cache_config
        self.kv = KVCacheManager(kv.groups, kv.num_blocks, kv.block_size, enable_prefix_caching=False)
        self.eos = frozenset(target_tokenizer.eos_token_ids)
        self.k = num_speculative_tokens
        self.seqs: dict[str, _DraftSeq] = {}
        self.runner_tables = RunnerBlockTables()   # what the draft runner holds of each table
        self._dropped: list[str] = []      # tell the draft runner to forget these next round

    def release(self, live_request_ids: set[str]) -> None:
        for request_id in [r for r in self.seqs if r not in live_request_ids]:
            self.kv.free(self.seqs.pop(request_id))
            if self.runner_tables.forget(request_id):
                self._dropped.append(request_id)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        active: list[tuple[DraftRequest, _DraftSeq]] = []
        new_requests, cached_requests = [], []
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
            if request.request_id not in self.runner_tables:
                new_requests.append(NewRequestData(request.request_id, list(request.token_ids), [], _DRAFT_PARAMS,
                                                   self.eos, self.runner_tables.new_request(request.request_id,
                                                                                            seq.block_ids)))
            else:
                cached_requests.append(self._diff(seq, request.token_ids))
            seq.num_runner_real, seq.runner_drafts = len(request.token_ids), []
        drafts = {request.request_id: Draft() for request, _ in active}
        for step in range(self.k):
            chunks = []
            for request, seq in active:
                if step >= min(self.k, request.max_drafts):
                    continue
                start = seq.num_computed_tokens
                total = len(request.token_ids) + step   # tokens known to the draft runner now
                chunks.append(ScheduledChunk(request.request_id, start, total - start, sample=True))
                seq.num_computed_tokens = total
            if not chunks:
                break
            plan = SchedulerPlan(new_requests, cached_requests, chunks, self._dropped,
                                 sum(c.num_tokens for c in chunks))
            new_requests, cached_requests, self._dropped = [], [], []
            result = self.executor.execute(plan)
            for chunk in chunks:
                token = result.sampled_token_ids[chunk.request_id][0]
                logprob = result.logprobs[chunk.request_id][0][token].logprob
                draft = drafts[chunk.request_id]
                draft.token_ids.append(token)
                draft.confidences.append(math.exp(logprob))
        for request, seq in active:
            seq.runner_drafts = list(drafts[request.request_id].token_ids)   # the runner appended them
        return drafts

    def _diff(self, seq: _DraftSeq, token_ids: Sequence[int]) -> CachedRequestData:
        """What the draft runner's copy of a request lacks: its drafts the target accepted stay,
        the rest go, and the request's tokens after them come."""
        base, held = seq.num_runner_real, seq.runner_drafts
        assert len(token_ids) >= base, "a running request's tokens never shrink"
        kept = 0
        while kept < len(held) and base + kept < len(token_ids) and token_ids[base + kept] == held[kept]:
            kept += 1
        return CachedRequestData(seq.request_id, self.runner_tables.diff(seq.request_id, seq.block_ids),
                                 list(token_ids[base + kept:]), len(held) - kept)

    def _sync(self, seq: _DraftSeq, token_ids: Sequence[int]) -> None:
        """Keep the draft KV of drafts the target accepted; forget the rest."""
        if seq.num_computed_tokens > seq.num_runner_real:
            base = seq.num_runner_real
            kept = 0
            # Draft i sits at position base + i; its KV was computed iff it was fed back.
            while (kept < len(seq.runner_drafts) - 1 and base + kept < len(token_ids)
                   and token_ids[base + kept] == seq.runner_drafts[kept]):
                kept += 1
            seq.num_computed_tokens = min(seq.num_computed_tokens, base + kept)
        # The step computing the last known token samples draft 1: at least that one is left.
        seq.num_computed_tokens = min(seq.num_computed_tokens, max(len(token_ids) - 1, 0))


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
