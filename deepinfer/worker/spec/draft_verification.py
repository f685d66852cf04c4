"""The runner's side of draft verification: the target's rows of a verify step -> the verdicts.

A chunk with drafts d_1..d_m was run as 1 known token + m drafts (input_batch.py); its last
m + 1 rows give the target's logits after each draft prefix (spec_decode/verifier.py says how
they are accepted). The accepted tokens go into the result and into the request's token lists,
so the runner never holds a rejected draft.

Greedy verification without logit edits (the common case) needs nothing from the host but each
row's argmax, so it is queued like a sampled token: the argmax is copied to the host behind the
step, and the verdicts are taken when the step is collected. The engine core then hands the
step's outputs to its caller while the device still runs the step (engine/overlapped_loop.py). Until
then the requests' token lists lack this step's tokens, so no forward of theirs may be queued
(the core collects a verify step before it plans the next). Other verifications (sampling,
logprobs asked for) read host values at once and finish inside `verify_chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.platforms.transfer import to_host_async
from deepinfer.sample.logprobs import top_logprobs
from deepinfer.sample.sampler import SamplingRow, needs_edit
from deepinfer.sample.structured.bitmask import apply_grammar_bitmask
from deepinfer.spec_decode.verifier import VerifyRequest, VerifyResult, accept_greedy, verify
from deepinfer.types.plan import GrammarOutput, RunnerResult
from deepinfer.worker.request_states import RunnerRequestState, StepChunk


@dataclass
class PendingVerdicts:
    """Greedy verdicts of a launched step, taken at collect from the rows' argmax."""

    request_ids: list[str]
    requests: list[VerifyRequest]
    argmax: torch.Tensor   # host copy under way (read after the step's event has fired)

    def finish(self, states: dict[str, RunnerRequestState], result: RunnerResult) -> None:
        verdicts = accept_greedy(self.requests, self.argmax.tolist())
        for request_id, verdict in zip(self.request_ids, verdicts):
            _apply(states.get(request_id), request_id, verdict, result)


def verify_chunks(states: dict[str, RunnerRequestState], chunks: list[StepChunk], logits: torch.Tensor,
                  generators: list[torch.Generator | None], grammar: GrammarOutput | None,
                  result: RunnerResult) -> PendingVerdicts | None:
    """Verify the chunks' drafts from `logits` (the chunks' m + 1 rows each, back to back);
    generators: each chunk's request's, reseeded for this step. Returns the greedy verdicts
    still to take (None: every verdict is in `result` already)."""
    if grammar is not None:   # structured output: row j masked as after drafts 1..j
        apply_grammar_bitmask(logits, grammar, [(c.request_id, j) for c in chunks
                                                for j in range(len(c.spec_token_ids) + 1)])
    if all(plain_greedy(states[c.request_id]) for c in chunks):
        # Every row's argmax is the verdict's only input: no sampling rows to build.
        requests = [VerifyRequest(list(c.spec_token_ids), []) for c in chunks]
        return PendingVerdicts([c.request_id for c in chunks], requests, to_host_async(logits.argmax(dim=-1)))
    requests = [VerifyRequest(list(c.spec_token_ids), draft_rows(states[c.request_id], list(c.spec_token_ids)), g)
                for c, g in zip(chunks, generators)]
    offset = 0
    for chunk, request, verdict in zip(chunks, requests, verify(logits, requests)):
        state = states[chunk.request_id]
        _apply(state, chunk.request_id, verdict, result)
        if state.params.logprobs is not None:
            # Row j's raw logits are the target's at the position of the j-th emitted token.
            n = len(verdict.token_ids)
            entries = top_logprobs(logits[offset:offset + n], torch.tensor(verdict.token_ids), [state.params.logprobs] * n)
            result.logprobs[chunk.request_id] = [e.to_dict() for e in entries]
        offset += len(request.rows)
    return None


def plain_greedy(state: RunnerRequestState) -> bool:
    """Greedy, no logprobs, and no logit edits at any of the request's rows (its first row has
    the fewest outputs, so min_tokens ends there first)."""
    params = state.params
    return (params.temperature == 0 and params.logprobs is None
            and not needs_edit(params, SamplingRow(params, state.prompt_token_ids, state.output_token_ids)))


def _apply(state: RunnerRequestState | None, request_id: str, verdict: VerifyResult, result: RunnerResult) -> None:
    result.sampled_token_ids[request_id] = verdict.token_ids
    if state is not None:   # else dropped since (aborted): nothing to extend
        state.token_ids.extend(verdict.token_ids)
        state.output_token_ids.extend(verdict.token_ids)


def draft_rows(state: RunnerRequestState, drafts: list[int]) -> list[SamplingRow]:
    """The m + 1 sampling rows of a request verifying m drafts."""
    params = state.params
    outputs = state.output_token_ids
    rows = []
    for j in range(len(drafts) + 1):
        # Penalties, min_tokens and bad_words see the drafts before row j as generated output; other rows
        # only need the length, so they share the list instead of copying it per row.
        seen = (outputs + drafts[:j] if j and (params.has_penalties or params.min_tokens or params.bad_words_token_ids)
                else outputs)
        rows.append(SamplingRow(params, state.prompt_token_ids, seen, None, state.eos_token_ids))
    return rows
