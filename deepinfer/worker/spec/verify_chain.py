"""Verify chains: several verify steps of one plan, run back to back on the device.

A verify step's verdict decides the next step's inputs (how many drafts each request kept, so
where its next tokens start, the token the target chose, the drafts that follow it). Planned on
the host, that costs a step's host work while the device waits: collect the verdict, schedule,
draft, build the inputs, launch (a noticeable share of a step at batch 1 on the 8B shape:
docs/benchmarks/design-measurements.md#verify-chain-the-host-work-it-takes-off-the-devices-path).
A chain does it on the device instead. After step s's argmax, a few tensor ops take the verdict
(the leading drafts equal to the target's argmax), append the emitted tokens to a device copy of
each request's tokens, draft from it (chain_drafters.py: n-gram lookup, or the replay drafter's
table),
move the rows' token ids, positions, KV lengths and KV write rows in the decode CUDA graph's
buffers, and replay the graph. The host queues the whole chain without waiting, and at collect
`ChainVerdicts` takes the same verdicts again from host copies of every step's argmax and drafts.

When a plan may chain (the scheduler's SchedulerPlan.verify_chain > 1, which also means it
allocated KV for verify_chain * (k + 1) tokens from each chunk's start: every draft accepted at
every step), the runner still runs one step unless (`VerifyChain.prepare`):
- every chunk is a generating request (one known token + up to k drafts), plain greedy (the
  verdict is an argmax match: draft_verification.plain_greedy), with no window or write floor
  and no per-request model state;
- the step replays a captured graph whose buffers can advance (the Triton backend's), and the
  model has no sliding-window layer.
Every request verifies m drafts at every step, m the most any chunk of the plan has (k under
fixed verification; what the adaptive policy admitted at this batch size otherwise): one with
fewer (an n-gram miss, the end of a recording, none at all in the plan) is padded with token-0
rows that the verdict does not read (`valid` counts the real ones); a padded row's KV lands past
the accepted tokens, which the scheduler frees. A request that stops inside the chain (EOS,
max_tokens, a stop string) is computed to its end; the scheduler drops the tokens after its stop.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from deepinfer.platforms.transfer import to_device, to_host_async
from deepinfer.spec_decode.method import SpeculativeMethod
from deepinfer.spec_decode.verifier import greedy_verdict
from deepinfer.types.plan import RunnerResult
from deepinfer.worker.request_states import RunnerRequestState, StepChunk
from deepinfer.worker.spec.chain_drafters import PAD_TOKEN, ChainDrafter, chain_drafter
from deepinfer.worker.spec.draft_verification import plain_greedy

logger = logging.getLogger(__name__)


@dataclass
class ChainStart:
    """A step that will be chained: how many steps, and each chunk's real drafts in the first."""

    steps: int
    valid: list[int]
    num_drafts: int       # m: drafts a request verifies at every step of the chain (<= k)


@dataclass
class ChainVerdicts:
    """The verdicts of a chain, taken at collect from host copies of every step's argmax [S, B, R],
    drafts [S, B, k] and real-draft counts [S, B] (the same rule as the device applied)."""

    request_ids: list[str]
    argmax: torch.Tensor
    drafts: torch.Tensor
    valid: torch.Tensor

    def finish(self, states: dict[str, RunnerRequestState], result: RunnerResult) -> None:
        argmax, drafts, valid = self.argmax.tolist(), self.drafts.tolist(), self.valid.tolist()
        result.num_verify_steps = len(argmax)
        for row, request_id in enumerate(self.request_ids):
            tokens, steps = [], []
            for step_argmax, step_drafts, step_valid in zip(argmax, drafts, valid):
                n = step_valid[row]
                verdict = greedy_verdict(step_drafts[row][:n], step_argmax[row])
                tokens += verdict.token_ids
                steps.append((n, verdict.num_accepted))
            result.sampled_token_ids[request_id] = tokens
            result.verify_steps[request_id] = steps
            state = states.get(request_id)
            if state is not None:   # else dropped since (aborted): nothing to extend
                state.token_ids.extend(tokens)
                state.output_token_ids.extend(tokens)


def accepted_drafts(argmax: torch.Tensor, drafts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading drafts (of its `valid` real ones) equal the target's argmax."""
    k = drafts.shape[1]
    match = (argmax[:, :k] == drafts) & (torch.arange(k, device=drafts.device)[None, :] < valid[:, None])
    return match.long().cumprod(dim=1).sum(dim=1)


class VerifyChain:
    """The runner's chain: decides whether a step chains (`prepare`) and queues it (`run`)."""

    def __init__(self, drafter: ChainDrafter, graphs, k: int, device: torch.device) -> None:
        self.drafter, self.graphs, self.k, self.device = drafter, graphs, k, device
        self.num_chains = self.num_steps = 0   # chains run, and their verify steps

    def prepare(self, steps: int, chunks: list[StepChunk],
                states: dict[str, RunnerRequestState]) -> tuple[list[StepChunk], ChainStart | None]:
        """The chunks to lay out (drafts padded to the most any chunk has: m, which every step of
        the chain then verifies) and the chain, or the chunks as they are and None when this
        step runs alone."""
        m = max((len(c.spec_token_ids) for c in chunks), default=0)
        if steps < 2 or not m or m > self.k or len(chunks) * (m + 1) > self.graphs.max_batch:
            return chunks, None
        for c in chunks:
            state = states[c.request_id]
            if (not c.sample or c.num_tokens != 1 + len(c.spec_token_ids)
                    or c.prompt_logprobs or c.window_floor or c.write_floor or c.model_state
                    or state.num_placeholders or not plain_greedy(state)):
                return chunks, None
        padded = [dataclasses.replace(c, num_tokens=1 + m, spec_token_ids=c.spec_token_ids
                                      + [PAD_TOKEN] * (m - len(c.spec_token_ids))) for c in chunks]
        return padded, ChainStart(steps, [len(c.spec_token_ids) for c in chunks], m)

    def run(self, start: ChainStart, chunks: list[StepChunk], positions: torch.Tensor, logits: torch.Tensor,
            states: dict[str, RunnerRequestState]) -> ChainVerdicts:
        """Queue the chain's later steps behind its first (already queued: `logits`, every row's,
        and `positions`, every row's, laid out request by request, m + 1 rows each)."""
        m, device = start.num_drafts, self.device
        rows, width = len(chunks), m + 1
        offsets = torch.arange(width, device=device)
        drafts = to_device([c.spec_token_ids for c in chunks], device, torch.long)
        valid = to_device(start.valid, device, torch.long)
        first = positions.view(rows, width)[:, 0]
        state = self.drafter.begin(chunks, states, start.steps * width, device)
        self.num_chains += 1
        self.num_steps += start.steps
        argmaxes, all_drafts, all_valid = [], [drafts], [valid]
        for step in range(start.steps):
            argmax = logits.view(rows, width, -1).argmax(dim=-1)
            argmaxes.append(argmax)
            if step == start.steps - 1:
                break
            accepted = accepted_drafts(argmax, drafts, valid)
            # The next step starts at the token the target chose after the accepted drafts.
            first = first + accepted + 1
            bonus = argmax.gather(1, accepted[:, None])
            drafts, valid = self.drafter.propose(state, argmax, accepted, m)
            drafts = torch.where(torch.arange(m, device=device)[None, :] < valid[:, None], drafts, PAD_TOKEN)
            all_drafts.append(drafts)
            all_valid.append(valid)
            logits = self.graphs.replay_advanced(torch.cat([bonus, drafts], dim=1).flatten(),
                                                 (first[:, None] + offsets).flatten())
        return ChainVerdicts([c.request_id for c in chunks], to_host_async(torch.stack(argmaxes)),
                             to_host_async(torch.stack(all_drafts)), to_host_async(torch.stack(all_valid)))


def build_verify_chain(method: SpeculativeMethod | None, graphs, sliding_window: int, vocab_size: int,
                       seed: int, device: torch.device) -> VerifyChain | None:
    """The runner's chain where the method asks for one and this runner can run it (decode CUDA
    graphs whose buffers advance, no sliding-window layer); None: every plan runs one step.
    `seed`: the model's, from which a replay recording's table is drawn as the scheduler's is."""
    if method is None or not method.chains:
        return None
    if graphs is None or not graphs.can_advance() or sliding_window:
        logger.warning("speculative_config.verify_chain=%d has no effect here: verify chains need decode CUDA "
                       "graphs on the Triton backend and a model without sliding-window layers; every plan "
                       "runs one verify step", method.config.verify_chain)
        return None
    return VerifyChain(chain_drafter(method, vocab_size, seed), graphs, method.k, device)
