"""The persistent, shared KV store tier (`kv_store`): both sides of the connector over a backend
(backend.py: dir.py or redis.py).

Entries are content-addressed by TierKey (group key, block hash), like the host tier's, so any
instance with the same model, revision, block size, KV dtype, TP rank and layer group finds the
blocks another computed (the chain's root and connector.group_key carry those). Only persisted
kinds are written; sliding-window KV never is. Each entry has a header (entry.py) checked before
its bytes reach a device block: a bad entry is dropped, counted, and its load fails, so the
request recomputes.

Scheduler side (StoreTierScheduler): look-ups ask the backend (dir: a stat per block, Redis: one
pipelined STRLEN) about the blocks after those it saw there within KNOWN_TTL_S, stopping at the
first miss; there are no pins (another instance may drop an
entry at any time: the load then fails, and the request recomputes). Blocks this side saw in the
store within KNOWN_TTL_S are not offered for saving again (a block loaded from the store is
published like any computed block); that memory is cleared when a store call fails (a Redis may
come back empty). A store that is down or refuses answers "no hit" and takes
no saves (StoreHealth: warn once, count, retry after a back-off).

Worker side (StoreTierWorker, persistent_worker.py):
  saves   after the forward, the blocks are copied device -> slots of the staging buffer
          (staging.py, kv_store_buffer_size; a side stream and an event on CUDA), and the save is
          reported finished once that copy completed (the device blocks may be reused from then
          on). A writer thread skips entries the store has, encodes and writes the rest, spread
          over I/O threads. A save larger than the buffer's room streams through it: what does
          not fit waits (its device blocks held) and is staged once the writer frees slots; the
          step never blocks on it. Until written, a staged block is served to loads from its slot.
  loads   start_transfers hands each load to a reader thread, which reads and checks the entries
          into staging slots (over the I/O threads) and touches them (their retention restarts);
          the step thread copies them into the device blocks when it polls (finished_transfers).
          A load larger than the loads' half of the buffer is read in pieces, each copied in
          and its slots freed before the next (persistent_loads.py). A load that fails (an
          entry missing or bad, the store down) or is not read within load_timeout_s is reported
          by failed_transfers() instead of finished_transfers(): its device blocks were never
          written, and the scheduler must recompute the request (FinishedTransfers.failed).
  close   flushes what is queued within flush_timeout_s, then stops the threads.

Traffic class (types/traffic_class.py: the request field, the X-Traffic-Class header):
save_blocks and allocate_loads take `traffic_class` (None: DEFAULT_CLASS, "chat"); it is the
entry's retention class (kv_retention) at write, and the class a use touches it under, so an
entry's retention counts from its last use under the class of the request that last used it.
Uses are: a load (the reader touches what it read), a save of a block the store already has (the
writer touches it), and a hit on the device prefix cache (`touch`, at most once per key every
TOUCH_EVERY_S, so a hot prefix costs the store nothing per request; a day-scale retention does
not notice minutes).
"""

from __future__ import annotations

import collections
import logging
import queue
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from deepinfer.kv_cache.connector import TierKey, group_key
from deepinfer.kv_cache.specs import KVCacheGroup
from deepinfer.kv_cache.store.backend import PRESENT, WRONG_SIZE, StoreBackend, StoreHealth
from deepinfer.kv_cache.store.entry import EntryLayout
from deepinfer.kv_cache.store.transfers import TierSchedulerBase, _Transfer
from deepinfer.types.plan import KVTransfer
from deepinfer.types.tier_stats import KVConnectorStats
from deepinfer.types.traffic_class import DEFAULT_CLASS

if TYPE_CHECKING:
    from deepinfer.kv_cache.events import KVEventSink

logger = logging.getLogger(__name__)

KNOWN_TTL_S = 60.0
KNOWN_MAX = 1 << 16
TOUCH_EVERY_S = 300.0
GC_INTERVAL_S = 60.0
THREAD_POLL_S = 1.0
_STOP = object()


def _serve(ref: weakref.ref, work: queue.Queue, handler: str) -> None:
    """A worker thread: hand each queued item to the worker's `handler` (None on an idle
    tick), until _STOP or the worker is gone."""
    while True:
        try:
            item = work.get(timeout=THREAD_POLL_S)
        except queue.Empty:
            item = None
        if item is _STOP:
            return
        worker = ref()
        if worker is None:
            return
        getattr(worker, handler)(item)
        del worker


def group_layouts(groups: Sequence[KVCacheGroup], block_size: int, key_extra: bytes = b""
                  ) -> dict[int, tuple[bytes, EntryLayout]]:
    """Per persisted group id: its group key and the layout of its entries."""
    out = {}
    for g in groups:
        if g.spec.persisted:
            dtype = str(g.spec.storage_dtype).removeprefix("torch.")
            tensors = 1 if g.spec.shared_kv else 2
            out[g.group_id] = (group_key(g, block_size, key_extra),
                               EntryLayout(len(g.layer_ids), g.spec.page_bytes(block_size) // tensors, dtype, tensors))
    return out


def report_removals(layouts: Mapping[int, tuple[bytes, EntryLayout]], sink: KVEventSink, medium: str):
    """A backend's on_removed that publishes BlockRemoved per layer group (entries of groups not
    this engine's, another model's in a shared store, are not its events)."""
    def removed(keys: Sequence[TierKey]) -> None:
        group_of = {gk: group_id for group_id, (gk, _) in layouts.items()}
        by_group: dict[int, list[bytes]] = {}
        for gk, block_hash in keys:
            if gk in group_of:
                by_group.setdefault(group_of[gk], []).append(block_hash)
        for group_id, hashes in by_group.items():
            sink.removed(hashes, medium, group_id)
    return removed


def _check_class(traffic_class: str | None, retention: Mapping[str, float]) -> str:
    traffic_class = traffic_class or DEFAULT_CLASS
    if traffic_class not in retention:
        raise ValueError(f"traffic class {traffic_class!r} has no retention in kv_retention "
                         f"(classes: {', '.join(retention)})")
    return traffic_class


# ---------------------------------------------------------------------------- scheduler side
class StoreTierScheduler(TierSchedulerBase):
    tier_name = "store"

    def __init__(self, groups: Sequence[KVCacheGroup], block_size: int, backend: StoreBackend,
                 key_extra: bytes = b"", backoff_s: float = 1.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.backend = backend
        self.health = StoreHealth(backend.url, backoff_s)
        self._layouts = group_layouts(groups, block_size, key_extra)
        if not self._layouts:
            raise ValueError("no layer group's KV kind may be persisted (sliding-window KV never is)")
        # No bound on a request's loads: they stream through the worker's staging buffer
        # (persistent_loads.py), so a hit is loaded whole however long it is.
        self._known: collections.OrderedDict[TierKey, float] = collections.OrderedDict()
        self._errors_seen = 0
        self._saving: set[TierKey] = set()      # queued or in flight saves of this instance
        self._touched: collections.OrderedDict[tuple[TierKey, str], float] = collections.OrderedDict()

    # ----------------------------------------------------------------------------- look-ups
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
                                   num_device_tokens: int, traffic_class: str | None = None) -> int:
        if num_device_tokens % self.block_size:
            raise ValueError(f"num_device_tokens={num_device_tokens} is not whole blocks of {self.block_size}")
        groups = [self._layouts[g] for g in group_ids if g in self._layouts]
        first = num_device_tokens // self.block_size
        hashes = request_hashes[first:]
        if not groups or not hashes:
            return 0
        keys = [(gk, h) for h in hashes for gk, _ in groups]
        sizes = [layout.entry_bytes for _ in hashes for _, layout in groups]
        per_block = len(groups)
        # The leading blocks this side saw in the store within KNOWN_TTL_S are not asked again (a
        # multi-turn conversation's prefix costs the store nothing per turn); should another
        # instance have dropped one since, its load fails and the request recomputes.
        now = time.monotonic()
        known = 0
        while known < len(hashes) and all(self._is_known(k, now) for k in keys[known * per_block:(known + 1) * per_block]):
            known += 1
        asked = keys[known * per_block:]
        states = [PRESENT] * (known * per_block)
        if asked:
            found = self.health.call("look-up", lambda: self.backend.exists(asked, sizes[known * per_block:]), None)
            if found is None:
                return 0
            states += found
        bad = [k for k, s in zip(keys, states) if s == WRONG_SIZE]
        if bad:   # truncated (or foreign) entries: drop them; the request computes those blocks
            self._stats.corrupt_entries += len(bad)
            self.health.call("delete", lambda: self.backend.delete(bad), None)
        n = 0
        while n < len(hashes) and all(s == PRESENT for s in states[n * per_block:(n + 1) * per_block]):
            n += 1
        self._remember(keys[:n * per_block], now)
        return n * self.block_size

    def touch(self, request_hashes: Sequence[bytes], group_ids: Sequence[int], traffic_class: str) -> None:
        traffic_class = _check_class(traffic_class, self.backend.retention)
        now = time.monotonic()
        keys = []
        for gk, _ in (self._layouts[g] for g in group_ids if g in self._layouts):
            for block_hash in request_hashes:
                mark = ((gk, block_hash), traffic_class)
                last = self._touched.get(mark)
                if last is None or now - last >= TOUCH_EVERY_S:
                    self._touched[mark] = now
                    self._touched.move_to_end(mark)
                    keys.append(mark[0])
        while len(self._touched) > KNOWN_MAX:
            self._touched.popitem(last=False)
        if keys:
            self.health.call("touch", lambda: self.backend.touch(keys, traffic_class), None)

    # -------------------------------------------------------------------------------- loads
    def allocate_loads(self, request_id: str, block_hashes: Sequence[bytes],
                       device_block_ids: Mapping[int, Sequence[int]],
                       traffic_class: str | None = None) -> list[KVTransfer]:
        traffic_class = _check_class(traffic_class, self.backend.retention)
        self._check_loads_allowed(request_id)
        for group_id, ids in device_block_ids.items():
            if group_id not in self._layouts:
                raise ValueError(f"layer group {group_id} is not persisted: its KV is rebuilt, never loaded")
            if len(ids) != len(block_hashes):
                raise ValueError(f"group {group_id}: {len(ids)} device blocks for {len(block_hashes)} hashes")
        transfers = []
        for group_id, ids in device_block_ids.items():
            if not ids:
                continue
            gk = self._layouts[group_id][0]
            transfer = self._new_transfer(True, request_id, group_id, ids, list(block_hashes), gk, traffic_class)
            self._queued_loads.append(transfer)
            transfers.append(transfer)
        return transfers

    def _new_transfer(self, is_load: bool, request_id: str, group_id: int, device_block_ids: Sequence[int],
                      hashes: list[bytes], gk: bytes, traffic_class: str) -> KVTransfer:
        transfer_id = self._new_transfer_id(is_load, request_id, [(gk, h) for h in hashes])
        return KVTransfer(transfer_id, request_id, group_id, list(device_block_ids), [],
                          block_hashes=hashes, traffic_class=traffic_class)

    # -------------------------------------------------------------------------------- saves
    def save_blocks(self, request_id: str, group_id: int, block_hashes: Sequence[bytes],
                    device_block_ids: Sequence[int], traffic_class: str | None = None) -> list[KVTransfer]:
        if len(block_hashes) != len(device_block_ids):
            raise ValueError(f"{len(device_block_ids)} device blocks for {len(block_hashes)} hashes")
        if group_id not in self._layouts:
            self._stats.refused_saves += len(block_hashes)   # sliding window: never persisted
            return []
        traffic_class = _check_class(traffic_class, self.backend.retention)
        self._check_saves_allowed(request_id)
        if not self.health.usable():
            self._stats.dropped_saves += len(block_hashes)   # the store is down: recompute later
            return []
        gk = self._layouts[group_id][0]
        now = time.monotonic()
        hashes, ids = [], []
        for block_hash, block_id in zip(block_hashes, device_block_ids):
            key = (gk, block_hash)
            if key in self._saving or self._is_known(key, now):
                continue   # being saved, or the store had it a moment ago
            self._saving.add(key)
            hashes.append(block_hash)
            ids.append(block_id)
        if not hashes:
            return []
        transfer = self._new_transfer(False, request_id, group_id, ids, hashes, gk, traffic_class)
        self._queued_saves.append(transfer)
        return [transfer]

    # ----------------------------------------------------------------------- step boundary
    def _load_finished(self, transfer: _Transfer, ok: bool) -> None:
        if ok:
            self._stats.loaded_blocks += len(transfer.keys)
            return
        self._stats.failed_loads += len(transfer.keys)
        for key in transfer.keys:
            self._known.pop(key, None)

    def _save_finished(self, transfer: _Transfer, ok: bool) -> None:
        self._saving.difference_update(transfer.keys)
        if ok:
            self._stats.saved_blocks += len(transfer.keys)
        else:
            self._stats.dropped_saves += len(transfer.keys)

    def stats(self) -> KVConnectorStats:
        stats = self._stats.copy()
        stats.store_errors = self.health.errors
        return stats

    def attach_kv_events(self, sink: KVEventSink) -> None:
        """Report the entries this side removes (found damaged by a look-up) as KV events."""
        self.backend.on_removed = report_removals(self._layouts, sink, self.backend.medium)


# ------------------------------------------------------------------------------- worker side
