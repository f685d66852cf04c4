"""The model runner's side of speculative decoding: verify drafts, and time verify-shaped steps.

A chunk with drafts was run as 1 known token + m drafts (input_batch.py); its last m + 1 hidden
states give the target's logits after each draft prefix. `verify_chunks` turns them into the
accepted tokens and updates the runner's per-request token lists with exactly those, so the
runner never holds a rejected draft.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.plan import RunnerResult, ScheduledChunk
from deepinfer.layers.attention import forward_context
from deepinfer.sample.logprobs import top_logprobs
from deepinfer.sample.sampler import SamplingRow
from deepinfer.spec_decode.verifier import VerifyRequest, verify
from deepinfer.worker.input_batch import build_step_inputs

if TYPE_CHECKING:
    from deepinfer.worker.model_runner import ModelRunner, RunnerRequestState


def _rows(state: RunnerRequestState, drafts: list[int]) -> list[SamplingRow]:
    params = state.params
    outputs = state.output_token_ids
    rows = []
    for j in range(len(drafts) + 1):
        # Penalties and min_tokens see the drafts before row j as generated output; other rows
        # only need the length, so they share the list instead of copying it per row.
        seen = outputs + drafts[:j] if j and (params.has_penalties or params.min_tokens) else outputs
        rows.append(SamplingRow(params, state.prompt_token_ids, seen, None, state.eos_token_ids))
    return rows


def _generator(state: RunnerRequestState) -> torch.Generator | None:
    if state.generator is not None:
        # Same (seed, position) reseeding as plain sampling: a seeded request's draws depend on
        # its seed and logits only, not on its batch-mates.
        state.generator.manual_seed((state.params.seed * 1_000_003 + len(state.output_token_ids)) % 2**63)
    return state.generator


def verify_chunks(runner: ModelRunner, chunks: list[ScheduledChunk], last_indices: list[int],
                  hidden: torch.Tensor, result: RunnerResult, grammar_bitmask=None) -> None:
    index: list[int] = []
    requests = []
    for chunk, last in zip(chunks, last_indices):
        drafts = list(chunk.spec_token_ids)
        index.extend(range(last - len(drafts), last + 1))
        state = runner.requests[chunk.request_id]
        requests.append(VerifyRequest(drafts, _rows(state, drafts), _generator(state)))
    logits = runner.model.compute_logits(hidden[torch.tensor(index, device=runner.device)])
    if grammar_bitmask is not None:   # structured output: row j masked as after drafts 1..j
        grammar_bitmask.apply(logits, [(c.request_id, j) for c in chunks for j in range(len(c.spec_token_ids) + 1)])
    offset = 0
    for chunk, request, verdict in zip(chunks, requests, verify(logits, requests)):
        state = runner.requests[chunk.request_id]
        state.token_ids.extend(verdict.token_ids)
        state.output_token_ids.extend(verdict.token_ids)
        result.sampled_token_ids[chunk.request_id] = verdict.token_ids
        if state.params.logprobs is not None:
            # Row j's raw logits are the target's at the position of the j-th emitted token.
            n = len(verdict.token_ids)
            entries = top_logprobs(logits[offset:offset + n], torch.tensor(verdict.token_ids),
                                   [state.params.logprobs] * n)
            result.logprobs[chunk.request_id] = [e.to_dict() for e in entries]
        offset += len(request.rows)


@torch.inference_mode()
def time_forward(runner: ModelRunner, num_seqs: int, num_query: int, context: int = 128) -> float:
    """Seconds for one verify-shaped step: num_seqs sequences, each 1 token + num_query - 1 drafts
    at `context` tokens of history, logits at every query token. Runs at start-up only: it writes
    garbage KV into the first blocks, which no request owns yet."""
    bs = runner.block_size
    context = max(min(context, (runner.num_blocks - 1) * bs - num_query), 0)
    blocks = list(range(1, -(-(context + num_query) // bs) + 1))
    chunks = [ScheduledChunk(f"profile-{i}", context, num_query, [blocks for _ in runner.groups], True,
                             spec_token_ids=[0] * (num_query - 1)) for i in range(num_seqs)]
    token_ids = {c.request_id: [0] * (context + 1) for c in chunks}
    start = time.perf_counter()
    inputs = build_step_inputs(chunks, token_ids, runner.groups, bs, runner.layer_to_group,
                               runner.layer_to_slot, runner.kv_caches, runner.device,
                               backend=runner.attention_backend, decode_splits=runner.decode_splits(len(chunks)))
    with forward_context(inputs.attention):
        hidden = runner.model(inputs.input_ids, inputs.positions)
    runner.model.compute_logits(hidden).argmax(dim=-1).tolist()   # .tolist() waits for the device
    return time.perf_counter() - start
