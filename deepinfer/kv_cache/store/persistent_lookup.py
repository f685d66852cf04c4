"""The persistent store's look-ups (StoreTierScheduler's base): how many blocks past the device's
prefix the store holds, for every persisted group, in whole entries (runs.py).

The existence checks are what a look-up costs, so it makes one per run, not per block:
  1. each run's end from the run holding the first block the device lacks, in order, the last
     cut at the request's end: one check per run and group (exists(): dir stops at the first
     miss; Redis asks them all in one pipelined round trip). Runs this side saw in the store
     within KNOWN_TTL_S are not asked again (a conversation's next turn costs the store only its
     new runs).
  2. if a run is missing, a shorter entry of that run (a request that ended inside it left one)
     may still extend the prefix: its possible ends are checked from the longest down
     (first_present(): dir stops at the first found, Redis asks them in one round trip), at most
     run_blocks - 1 of them, for that run only.
An entry of the wrong size (truncated, another format's, another grid's) is deleted and counted
on the way; the look-up treats it as absent.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence

from deepinfer.kv_cache.connector import TierKey
from deepinfer.kv_cache.store.backend import PRESENT, WRONG_SIZE, StoreBackend, StoreHealth
from deepinfer.kv_cache.store.entry import EntryLayout
from deepinfer.kv_cache.store.runs import look_up_ends, partial_ends, run_start
from deepinfer.kv_cache.store.transfers import TierSchedulerBase

KNOWN_TTL_S = 60.0
KNOWN_MAX = 1 << 16

_DOWN = object()   # a store call failed: the look-up answers "no hit"


class StoreLookups(TierSchedulerBase):
    """The look-up half of StoreTierScheduler (its block_size, run_blocks and _layouts are the
    subclass's)."""

    block_size: int
    run_blocks: int
    _layouts: dict[int, tuple[bytes, EntryLayout]]

    def __init__(self, backend: StoreBackend, backoff_s: float) -> None:
        super().__init__()
        self.backend = backend
        self.health = StoreHealth(backend.url, backoff_s)
        self._known: collections.OrderedDict[TierKey, float] = collections.OrderedDict()
        self._errors_seen = 0
        self._touched: collections.OrderedDict[tuple[TierKey, str], float] = collections.OrderedDict()

    def _is_known(self, key: TierKey, now: float) -> bool:
        if self.health.errors != self._errors_seen:
            # The store failed since: it may have lost what it held (a Redis restarted empty).
            self._errors_seen = self.health.errors
            self._known.clear()
        seen = self._known.get(key)
        return seen is not None and now - seen < KNOWN_TTL_S

    def _remember(self, keys: Sequence[TierKey], now: float) -> None:
        for key in keys:
            self._known[key] = now
            self._known.move_to_end(key)
        while len(self._known) > KNOWN_MAX:
            self._known.popitem(last=False)

    def get_num_new_matched_tokens(self, request_hashes: Sequence[bytes], group_ids: Sequence[int],
                                   num_device_tokens: int, traffic_class: str | None = None,
                                   next_hash: bytes | None = None) -> int:
        if num_device_tokens % self.block_size:
            raise ValueError(f"num_device_tokens={num_device_tokens} is not whole blocks of {self.block_size}")
        groups = [self._layouts[g] for g in group_ids if g in self._layouts]
        first, usable = num_device_tokens // self.block_size, len(request_hashes)
        if not groups or first >= usable:
            return 0
        # The request's next block (full, but holding the last token it must compute) may end an
        # entry: the one a request of this very prompt stored. Its blocks but that one are a hit.
        hashes = [*request_hashes, next_hash] if next_hash is not None else request_hashes
        ends = look_up_ends(first, len(hashes), self.run_blocks)
        now = time.monotonic()
        known = 0
        while known < len(ends) and all(self._is_known(key, now) for key in self._keys(groups, hashes, ends[known])):
            known += 1
        present = known
        if known < len(ends):
            found = self._present_runs(groups, hashes, ends[known:])
            if found is _DOWN:
                return 0
            present += found
        end = ends[present - 1] if present else first
        if present < len(ends):
            shorter = self._shorter_entry(groups, hashes, ends[present], first)
            if shorter is _DOWN:
                return 0
            end = shorter or end
        self._remember([k for e in ends[:present] for k in self._keys(groups, hashes, e)], now)
        if end > (ends[present - 1] if present else first):
            self._remember(self._keys(groups, hashes, end), now)
        return (min(end, usable) - first) * self.block_size

    # ------------------------------------------------------------------------------ helpers
    def _keys(self, groups, hashes: Sequence[bytes], end: int) -> list[TierKey]:
        """Every group's key of the entry that ends at block `end` (exclusive)."""
        return [(gk, hashes[end - 1]) for gk, _ in groups]

    def _sizes(self, groups, end: int) -> list[int]:
        return [layout.entry_bytes(end - run_start(end, self.run_blocks)) for _, layout in groups]

    def _present_runs(self, groups, hashes: Sequence[bytes], ends: list[int]):
        """How many of the runs ending at `ends` are there, in every group, counted from the first."""
        keys = [k for e in ends for k in self._keys(groups, hashes, e)]
        sizes = [s for e in ends for s in self._sizes(groups, e)]
        states = self.health.call("look-up", lambda: self.backend.exists(keys, sizes), None)
        if states is None:
            return _DOWN
        self._drop_wrong_size(keys, states)
        per_run = len(groups)
        n = 0
        while n < len(ends) and all(s == PRESENT for s in states[n * per_run:(n + 1) * per_run]):
            n += 1
        return n

    def _shorter_entry(self, groups, hashes: Sequence[bytes], end: int, first: int):
        """The longest shorter entry of the run that ends at `end` present in every group: its
        end, or None."""
        candidates = partial_ends(end, first, self.run_blocks)
        (gk, layout), others = groups[0], groups[1:]
        while candidates:
            keys = [(gk, hashes[e - 1]) for e in candidates]
            sizes = [layout.entry_bytes(e - run_start(e, self.run_blocks)) for e in candidates]
            states = self.health.call("look-up", lambda k=keys, s=sizes: self.backend.first_present(k, s), None)
            if states is None:
                return _DOWN
            self._drop_wrong_size(keys, states)
            hit = next((i for i, s in enumerate(states) if s == PRESENT), None)
            if hit is None:
                return None
            if not others or self._present_runs(others, hashes, [candidates[hit]]) == 1:
                return candidates[hit]
            candidates = candidates[hit + 1:]
        return None

    def _drop_wrong_size(self, keys: list[TierKey], states: list[int]) -> None:
        bad = [k for k, s in zip(keys, states) if s == WRONG_SIZE]
        if bad:   # truncated (or foreign) entries: drop them; the request computes those blocks
            self._stats.corrupt_entries += len(bad)
            self.health.call("delete", lambda: self.backend.delete(bad), None)
