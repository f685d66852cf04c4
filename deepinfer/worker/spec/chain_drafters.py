"""Drafts for a verify chain's later steps, made on the device from the tokens emitted so far.

A chain (verify_chain.py) queues step s + 1 before the host has read step s's verdict, so the
drafts of step s + 1 must be computed where that verdict is: on the device, with no host sync.
Each drafter has two calls: `begin` builds its device state for the chain's requests, and
`propose` records a step's emitted tokens and returns the next drafts.

    NgramChainDrafter   the n-gram lookup of spec_decode/ngram.py (device_ngram.py) over a device
                        copy of each request's tokens, kept between chains (DeviceHistory)
    ReplayChainDrafter  the replay drafter's table of drafts by output position
                        (spec_decode/replay.py), the one the scheduler's drafter reads; a request
                        that leaves its recording gets no more drafts, as there

`chain_drafter` builds the one the resolved method drafts with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from deepinfer.platforms.transfer import to_device
from deepinfer.spec_decode.method import DraftSource, SpeculativeMethod
from deepinfer.worker.request_states import RunnerRequestState, StepChunk
from deepinfer.worker.spec.device_ngram import ngram_drafts

# Pads a drafts row past its real drafts (any id the embedding takes; the verdict never reads it).
PAD_TOKEN = 0


class ChainDrafter(ABC):
    def __init__(self, k: int) -> None:
        self.k = k

    def begin(self, chunks: list[StepChunk], states: dict[str, RunnerRequestState], extra: int,
              device: torch.device) -> dict[str, torch.Tensor]:
        """Device state for a chain over `chunks` that will append at most `extra` tokens a row."""
        lengths = np.fromiter((len(states[c.request_id].token_ids) for c in chunks), dtype=np.int64,
                              count=len(chunks))
        state = {"lengths": to_device(torch.from_numpy(lengths), device)}
        self._begin(state, chunks, states, int(lengths.max()), extra, device)
        return state

    @abstractmethod
    def _begin(self, state: dict[str, torch.Tensor], chunks: list[StepChunk], states: dict[str, RunnerRequestState],
               longest: int, extra: int, device: torch.device) -> None:
        """Add the drafter's own device state; `longest`: the most tokens a request has now."""

    @abstractmethod
    def propose(self, state: dict[str, torch.Tensor], emitted: torch.Tensor, accepted: torch.Tensor,
                num_drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Record a step's emitted tokens (each row's first accepted + 1 of `emitted` [B, R]) and
        return the next drafts [B, num_drafts] (default k) and how many of each row are real [B]."""


class NgramChainDrafter(ChainDrafter):
    def __init__(self, k: int, min_n: int = 1, max_n: int = 4) -> None:
        super().__init__(k)
        self.min_n, self.max_n = min_n, max_n
        self.history: DeviceHistory | None = None   # each request's tokens, kept on the device

    def _begin(self, state, chunks, states, longest, extra, device) -> None:
        if self.history is None:
            self.history = DeviceHistory(device)
        state["history"] = self.history.batch([c.request_id for c in chunks],
                                              [states[c.request_id].token_ids for c in chunks], states,
                                              longest + extra)

    def propose(self, state, emitted, accepted, num_drafts=None):
        m = self.k if num_drafts is None else num_drafts
        offsets = torch.arange(emitted.shape[1], device=emitted.device)
        history = state["history"]
        # Every emitted row goes in; only the first accepted + 1 count (lengths says so).
        history.scatter_(1, state["lengths"][:, None] + offsets, emitted)
        state["lengths"] = state["lengths"] + accepted + 1
        return ngram_drafts(history, state["lengths"], m, self.min_n, self.max_n)


class ReplayChainDrafter(ChainDrafter):
    def __init__(self, k: int, replay) -> None:
        super().__init__(k)
        self.replay = replay   # a ReplayDrafter (spec_decode/replay.py)

    def _begin(self, state, chunks, states, longest, extra, device) -> None:
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

    def _recording(self, state: RunnerRequestState) -> tuple[list[int], list[int], bool]:
        """(recorded outputs, drafts by output position, whether the request still follows them)."""
        drafts = self.replay.recording_for(state.token_ids)
        if drafts is None:
            return [], [], False
        recorded = drafts.recording.output_token_ids
        outputs = state.output_token_ids
        return recorded, drafts.token_ids, recorded[:len(outputs)] == outputs

    def propose(self, state, emitted, accepted, num_drafts=None):
        m = self.k if num_drafts is None else num_drafts
        offsets = torch.arange(emitted.shape[1], device=emitted.device)
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


def chain_drafter(method: SpeculativeMethod, vocab_size: int, seed: int) -> ChainDrafter:
    """The chain drafter of a method that drafts on the device (SpeculativeMethod.drafts_on_device)."""
    spec = method.config
    if method.source is DraftSource.NGRAM:
        return NgramChainDrafter(method.k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if method.source is DraftSource.REPLAY:
        from deepinfer.spec_decode.replay import ReplayDrafter

        # The scheduler's drafter is built from the same file and seed: the same table.
        return ReplayChainDrafter(method.k, ReplayDrafter.load(spec.replay_path, vocab_size, seed))
    raise ValueError(f"{method.source.value} drafts are not made on the device: no verify chain for it")
