"""Verify chains: several verify steps of one plan, run back to back on the device.

A verify step's verdict decides the next step's inputs (how many drafts each request kept, so
where its next tokens start, the token the target chose, the drafts that follow it). Planned on
the host, that costs a step's host work while the device waits: collect the verdict, schedule,
draft, build the inputs, launch (a noticeable share of a step at batch 1 on the 8B shape:
docs/benchmarks/design-measurements.md#verify-chain-the-host-work-it-takes-off-the-devices-path).
A chain does it on the device instead. After step s's argmax, a few tensor ops take the verdict
(the leading drafts equal to the target's argmax), append the emitted tokens to a device copy of
each request's tokens, draft from it (`ChainDrafter`: n-gram lookup, or the replay drafter's table),
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

import numpy as np
import torch

from deepinfer.platforms.transfer import to_device, to_host_async
from deepinfer.spec_decode.verifier import greedy_verdict
from deepinfer.types.plan import RunnerResult
from deepinfer.worker.draft_verification import plain_greedy
from deepinfer.worker.request_states import RunnerRequestState, StepChunk

logger = logging.getLogger(__name__)

# Pads a drafts row past its real drafts (any id the embedding takes; the verdict never reads it).
PAD_TOKEN = 0


@dataclass
class ChainStart:
    """A step that will be chained: how many steps, and each chunk's real drafts in the first."""

    steps: int
    valid: list[int]
    num_drafts: int       # m: drafts a request verifies at every step of the chain (<= k)


class ChainDrafter:
    """Drafts for a chain's later steps, on the device, from the tokens emitted so far.

    ngram: the n-gram lookup of spec_decode/ngram.py over a device copy of each request's
    tokens (spec_decode/device_ngram.py). replay: the replay drafter's table of drafts by output
    position (spec_decode/replay.py), the same one the scheduler's drafter reads; a request that
    leaves its recording gets no more drafts, as there.
    """

    def __init__(self, method: str, k: int, min_n: int = 1, max_n: int = 4, replay=None) -> None:
        self.method, self.k, self.min_n, self.max_n = method, k, min_n, max_n
        self.replay = replay   # a ReplayDrafter (method "replay")
        self.history: DeviceHistory | None = None   # ngram: each request's tokens, kept on the device

    def begin(self, chunks: list[StepChunk], states: dict[str, RunnerRequestState], extra: int,
              device: torch.device) -> dict[str, torch.Tensor]:
        """Device state for a chain over `chunks` that will append at most `extra` tokens a row."""
        token_lists = [states[c.request_id].token_ids for c in chunks]
        lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
        state = {"lengths": to_device(torch.from_numpy(lengths), device)}
        if self.method == "ngram":
            if self.history is None:
                self.history = DeviceHistory(device)
            state["history"] = self.history.batch([c.request_id for c in chunks], token_lists, states,
                                                  int(lengths.max()) + extra)
            return state
        tables = [self._recording(states[c.request_id]) for c in chunks]
        width = max(len(recorded) for recorded, _, _ in tables) + extra + self.k + 1
        recorded = np.full((len(tables), width), -1, dtype=np.int64)   # -1: past the recording
        changed = np.full((len(tables), width), PAD_TOKEN, dtype=np.int64)
        for row, (rec, chg, follows) in enumerate(tables):
            if follows:
                recorded[row, :len(rec)] = rec
                changed[row, :len(chg)] = chg
        done = [len(states[c.request_id].output_token_ids) for c in chunks]
        state.update(recorded=to_device(torch.from_numpy(recorded), device),
                     changed=to_device(torch.from_numpy(changed), device),
                     recorded_len=to_device([len(rec) if follows else 0 for rec, _, follows in tables], device, torch.long),
                     done=to_device(done, device, torch.long))
        return state

    def _recording(self, state: RunnerRequestState) -> tuple[list[int], list[int], bool]:
        """(recorded outputs, drafts by output position, whether the request still follows them)."""
        drafts = self.replay.recording_for(state.token_ids)
        if drafts is None:
            return [], [], False
        recorded = drafts.recording.output_token_ids
        outputs = state.output_token_ids
        return recorded, drafts.token_ids, recorded[:len(outputs)] == outputs

    def propose(self, state: dict[str, torch.Tensor], emitted: torch.Tensor, accepted: torch.Tensor,
                num_drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Record a step's emitted tokens (each row's first accepted + 1 of `emitted` [B, R]) and
        return the next drafts [B, num_drafts] (default k) and how many of each row are real [B]."""
        m = self.k if num_drafts is None else num_drafts
        rows, width = emitted.shape
        offsets = torch.arange(width, device=emitted.device)
        if self.method == "ngram":
            from deepinfer.spec_decode.device_ngram import ngram_drafts

            history = state["history"]
            # Every emitted row goes in; only the first accepted + 1 count (lengths says so).
            history.scatter_(1, state["lengths"][:, None] + offsets, emitted)
            state["lengths"] = state["lengths"] + accepted + 1
            return ngram_drafts(history, state["lengths"], m, self.min_n, self.max_n)
        recorded, done = state["recorded"], state["done"]
        last = recorded.shape[1] - 1
        expected = recorded.gather(1, (done[:, None] + offsets).clamp(max=last))
        kept = (emitted == expected) | (offsets[None, :] > accepted[:, None])
        follows = kept.all(dim=1)
        # A row that left its recording keeps no recording from here on (recorded_len 0).
        state["recorded_len"] = torch.where(follows, state["recorded_len"], 0)
        state["done"] = done = done + accepted + 1
        state["lengths"] = state["lengths"] + accepted + 1
        index = (done[:, None] + torch.arange(m, device=done.device)).clamp(max=last)
        valid = (state["recorded_len"] - done).clamp(min=0, max=m)
        drafts = state["changed"].gather(1, index)
        return drafts, valid


class DeviceHistory:
    """Every chained request's tokens on the device, one row each of a table that grows by
    doubling, so a chain uploads only the tokens added since the request's last chain (its
    verdicts, a few dozen) instead of its whole history (uploading the whole history of 16
    requests of 8k tokens was measured as a host cost on every chain, worth taking away:
    docs/benchmarks/design-measurements.md#verify-chain-request-tokens-kept-on-the-device).
    `batch` gathers the chain's rows in one device op; the chain then appends to that copy, never
    to the table."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.table = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.rows: dict[str, int] = {}      # request id -> its row
        self.lengths: dict[str, int] = {}   # tokens of the request the row holds
        self.free: list[int] = []

    def batch(self, request_ids: list[str], token_lists: list[list[int]], live: dict, width: int) -> torch.Tensor:
        """[len(request_ids), width] int64: each request's tokens, then whatever (never read)."""
        for request_id in [r for r in self.rows if r not in live]:   # finished or preempted
            self.free.append(self.rows.pop(request_id))
            del self.lengths[request_id]
        rows, cols, values = [], [], []
        for request_id, tokens in zip(request_ids, token_lists):
            row = self.rows.get(request_id)
            if row is None:
                row = self.rows[request_id] = self.free.pop() if self.free else len(self.rows) + len(self.free)
                self.lengths[request_id] = 0
            known = self.lengths[request_id]
            if known > len(tokens):   # the runner's list is shorter than what the row holds: rewrite
                known = 0
            rows.extend([row] * (len(tokens) - known))
            cols.extend(range(known, len(tokens)))
            values.extend(tokens[known:])
            self.lengths[request_id] = len(tokens)
        self._fit(max(self.rows.values(), default=-1) + 1, width)
        if values:
            index = to_device([rows, cols], self.device, torch.long)
            self.table.index_put_((index[0], index[1]), to_device(values, self.device, torch.long))
        batch_rows = to_device([self.rows[r] for r in request_ids], self.device, torch.long)
        return self.table.index_select(0, batch_rows)[:, :width]

    def _fit(self, num_rows: int, width: int) -> None:
        """Grow the table (doubling) to hold num_rows rows of width tokens."""
        old_rows, old_width = self.table.shape
        if num_rows <= old_rows and width <= old_width:
            return
        rows = old_rows if num_rows <= old_rows else max(num_rows, 2 * old_rows)
        cols = old_width if width <= old_width else max(width, 2 * old_width)
        grown = torch.zeros(rows, cols, dtype=torch.long, device=self.device)
        grown[:old_rows, :old_width] = self.table
        self.table = grown


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


def build_verify_chain(config, graphs, sliding_window: int, vocab_size: int,
                       device: torch.device) -> VerifyChain | None:
    """The runner's chain where the config asks for one and this runner can run it (decode CUDA
    graphs whose buffers advance, no sliding-window layer); None: every plan runs one step."""
    spec = config.speculative
    if spec is None or spec.verify_chain < 2:
        return None
    if graphs is None or not graphs.can_advance() or sliding_window:
        logger.warning("speculative_config.verify_chain=%d has no effect here: verify chains need decode CUDA "
                       "graphs on the Triton backend and a model without sliding-window layers; every plan "
                       "runs one verify step", spec.verify_chain)
        return None
    replay = None
    if spec.method == "replay":
        from deepinfer.spec_decode.replay import ReplayDrafter

        # The scheduler's drafter is built from the same file and seed: the same table.
        replay = ReplayDrafter.load(spec.replay_path, vocab_size, config.model.seed)
    drafter = ChainDrafter(spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min,
                           spec.prompt_lookup_max, replay)
    return VerifyChain(drafter, graphs, spec.num_speculative_tokens, device)
