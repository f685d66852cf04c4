"""The persistent, shared KV store tier (`kv_store`): both sides of the connector over a backend
(backend.py: dir.py or redis.py).

Entries are runs of blocks (runs.py: up to CHUNK_BLOCKS consecutive blocks of one layer group, on
a fixed grid of the request's chain), content-addressed by TierKey (group key, hash of the run's
last block), so any instance with the same model, revision, block size, KV dtype, TP rank and
layer group finds the runs another computed (the chain's root and connector.group_key carry
those). Only persisted kinds are written; sliding-window KV never is. Each entry has a header
(entry.py) checked before its bytes reach a device block: a bad entry is dropped, counted, and
its load fails, so the request recomputes (KVTierLink looks it up once more: the store then
answers with the prefix before the dropped run, which loads).

Scheduler side (StoreTierScheduler): look-ups (persistent_lookup.py) ask the backend about each
run's end past those it saw there within KNOWN_TTL_S, one existence check per run (dir: a stat,
Redis: a STRLEN, all of a call's in one pipelined round trip), stopping at the first run some
group lacks, whose shorter entries are then checked from the longest down; there are no pins
(another instance may drop an entry at any time: the load then fails, and the request
recomputes). Runs this side saw in the store within KNOWN_TTL_S are not offered for saving again
(a run loaded from the store is published like any computed block); that memory is cleared when
a store call fails (a Redis may come back empty). A store that is down or refuses answers "no
hit" and takes no saves (StoreHealth: warn once, count, retry after a back-off).

Saves: a request's computed blocks arrive with their positions (save_blocks) as steps publish
them and are gathered per group (runs.OpenRuns); each run is queued for saving once it is whole,
the shorter trailing run when the request finishes (request_finished, which then keeps the
request's blocks until that save left the device). The caller hands each save's blocks from its
run's grid line on (run_blocks), so a run whose first blocks came from a prefix hit is whole.

Worker side (StoreTierWorker, persistent_worker.py):
  saves   after the forward, the runs' blocks are copied device -> slots of the staging buffer
          (staging.py, kv_store_buffer_size; a side stream and an event on CUDA), and the save is
          reported finished once that copy completed (the device blocks may be reused from then
          on). A writer thread skips entries the store has, writes the rest (one writev of the
          header and the slots' bytes per run), spread over I/O threads. A save larger than the
          buffer's room streams through it, run by run: what does not fit waits (its device
          blocks held) and is staged once the writer frees slots; the step never blocks on it.
          Until written, a staged run is served to loads from its slots.
  loads   start_transfers hands each load to a reader thread, which hands its runs to the I/O
          threads one call each, several in flight; each is read (one readv straight into its
          slots) and checked, touched (its retention restarts), and copied into its device
          blocks by the step thread as soon as it landed, while later runs are still being read
          (persistent_loads.py). A load that fails (an entry missing or bad, the store down) or
          is not read within load_timeout_s is reported by failed_transfers() instead of
          finished_transfers(): the scheduler must recompute the request (FinishedTransfers.failed).
  close   flushes what is queued within flush_timeout_s, then stops the threads.

Traffic class (types/traffic_class.py: the request field, the X-Traffic-Class header):
save_blocks and allocate_loads take `traffic_class` (None: DEFAULT_CLASS, "chat"); it is the
entry's retention class (kv_retention) at write, and the class a use touches it under, so an
entry's retention counts from its last use under the class of the request that last used it.
Uses are: a load (the reader touches what it read), a save of a run the store already has (the
writer touches it), and a hit on the device prefix cache (`touch`, at most once per key every
TOUCH_EVERY_S, so a hot prefix costs the store nothing per request; a day-scale retention does
not notice minutes).
"""

from __future__ import annotations

import logging
import queue
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from deepinfer.kv_cache.connector import TierKey, group_key
from deepinfer.kv_cache.specs import KVCacheGroup
from deepinfer.kv_cache.store.backend import StoreBackend
from deepinfer.kv_cache.store.entry import EntryLayout
from deepinfer.kv_cache.store.persistent_lookup import KNOWN_MAX, StoreLookups
from deepinfer.kv_cache.store.runs import CHUNK_BLOCKS, OpenRuns, look_up_ends, run_start, runs_of
from deepinfer.kv_cache.store.transfers import _Transfer
from deepinfer.types.plan import SKIP_BLOCK, KVTransfer
from deepinfer.types.tier_stats import KVConnectorStats
from deepinfer.types.traffic_class import DEFAULT_CLASS

if TYPE_CHECKING:
    from deepinfer.kv_cache.events import KVEventSink

logger = logging.getLogger(__name__)

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
    """Per persisted group id: its group key and the layout of its entries' blocks."""
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
    this engine's, another model's in a shared store, are not its events). An entry is named by
    its run's last block, the one hash a removal knows: a router that saw the run's blocks
    stored then sees the prefix end before that block."""
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
class StoreTierScheduler(StoreLookups):
    tier_name = "store"

    def __init__(self, groups: Sequence[KVCacheGroup], block_size: int, backend: StoreBackend,
                 key_extra: bytes = b"", backoff_s: float = 1.0, run_blocks: int = CHUNK_BLOCKS) -> None:
        super().__init__(backend, backoff_s)
        self.block_size = block_size
        # Saves and loads are of whole runs of this many blocks (runs.py); the caller hands each
        # save's blocks from its run's grid line on.
        self.run_blocks = run_blocks
        self._layouts = group_layouts(groups, block_size, key_extra)
        if not self._layouts:
            raise ValueError("no layer group's KV kind may be persisted (sliding-window KV never is)")
        # No bound on a request's loads: they stream through the worker's staging buffer
        # (persistent_loads.py), so a hit is loaded whole however long it is.
        self._saving: set[TierKey] = set()      # queued or in flight saves of this instance (run keys)
        # Per request and group: its computed blocks not in a whole run yet, and their class.
        self._open: dict[str, dict[int, tuple[OpenRuns, str]]] = {}

    def touch(self, request_hashes: Sequence[bytes], group_ids: Sequence[int], traffic_class: str) -> None:
        """The runs of a device prefix hit: each grid run's entry, and the entry that would end
        where the hit does (a shorter run a previous turn left there; absent ones are ignored)."""
        traffic_class = _check_class(traffic_class, self.backend.retention)
        now = time.monotonic()
        keys = []
        ends = look_up_ends(0, len(request_hashes), self.run_blocks)
        for gk, _ in (self._layouts[g] for g in group_ids if g in self._layouts):
            for end in ends:
                mark = ((gk, request_hashes[end - 1]), traffic_class)
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
                       traffic_class: str | None = None, first_block: int = 0) -> list[KVTransfer]:
        """`block_hashes`: the request's blocks from `first_block` (the device's prefix) on, at
        least as many as device_block_ids[g] (the blocks it takes from the store; fewer than the
        look-up found where the hit is cut, e.g. by replay). Entries are read whole: the first
        run's blocks before `first_block` and the last run's past the hit are read, not copied;
        the last run's entry is the shortest one the look-up saw that holds the hit's end."""
        traffic_class = _check_class(traffic_class, self.backend.retention)
        self._check_loads_allowed(request_id)
        for group_id, ids in device_block_ids.items():
            if group_id not in self._layouts:
                raise ValueError(f"layer group {group_id} is not persisted: its KV is rebuilt, never loaded")
            if len(ids) > len(block_hashes):
                raise ValueError(f"group {group_id}: {len(ids)} device blocks for {len(block_hashes)} hashes")
        transfers = []
        for group_id, ids in device_block_ids.items():
            if not ids:
                continue
            gk = self._layouts[group_id][0]
            end = self._entry_end(gk, block_hashes, first_block, first_block + len(ids))
            runs = runs_of(first_block, end, self.run_blocks)
            skip = first_block - runs[0][0]
            # Blocks of the first run before `first_block` are on the device already (hash unknown here).
            hashes = [b""] * skip + list(block_hashes[:end - first_block])
            targets = [SKIP_BLOCK] * skip + list(ids) + [SKIP_BLOCK] * (end - first_block - len(ids))
            keys = [(gk, hashes[stop - runs[0][0] - 1]) for _, stop in runs]
            transfer_id = self._new_transfer_id(True, request_id, keys, sum(b != SKIP_BLOCK for b in ids))
            transfer = KVTransfer(transfer_id, request_id, group_id, targets, [], block_hashes=hashes,
                                  traffic_class=traffic_class, run_lengths=[stop - start for start, stop in runs])
            self._queued_loads.append(transfer)
            transfers.append(transfer)
        return transfers

    def _entry_end(self, gk: bytes, block_hashes: Sequence[bytes], first_block: int, hit_end: int) -> int:
        """Where the entry that holds block hit_end - 1 ends: the shortest the look-up saw in
        that run reaching hit_end (the hit may stop short of an entry: a prompt's last block is
        always computed, a replay takes fewer blocks), else hit_end itself."""
        now = time.monotonic()
        last = min(run_start(hit_end, self.run_blocks) + self.run_blocks, first_block + len(block_hashes))
        for end in range(hit_end, last + 1):
            if self._is_known((gk, block_hashes[end - 1 - first_block]), now):
                return end
        return hit_end

    # -------------------------------------------------------------------------------- saves
    def save_blocks(self, request_id: str, group_id: int, block_hashes: Sequence[bytes],
                    device_block_ids: Sequence[int], traffic_class: str | None = None,
                    positions: Sequence[int] | None = None) -> list[KVTransfer]:
        """`positions`: each block's index in the request's chain; its runs are queued as they
        become whole, the shorter last one at request_finished. None: the blocks are a whole
        prefix from block 0 (a tool or a test handing one over): every run is queued now, the
        shorter last one included."""
        if len(block_hashes) != len(device_block_ids):
            raise ValueError(f"{len(device_block_ids)} device blocks for {len(block_hashes)} hashes")
        if group_id not in self._layouts:
            self._stats.refused_saves += len(block_hashes)   # sliding window: never persisted
            return []
        traffic_class = _check_class(traffic_class, self.backend.retention)
        self._check_saves_allowed(request_id)
        if positions is None:
            gathered = OpenRuns(self.run_blocks)
            runs = gathered.add(range(len(block_hashes)), block_hashes, device_block_ids) + gathered.drain()
        else:
            if len(positions) != len(block_hashes):
                raise ValueError(f"{len(positions)} positions for {len(block_hashes)} hashes")
            groups = self._open.setdefault(request_id, {})
            gathered = groups[group_id][0] if group_id in groups else OpenRuns(self.run_blocks)
            groups[group_id] = (gathered, traffic_class)
            runs = gathered.add(positions, block_hashes, device_block_ids)
        return self._queue_saves(request_id, group_id, runs, traffic_class)

    def _queue_saves(self, request_id: str, group_id: int, runs: list[tuple[int, list[bytes], list[int]]],
                     traffic_class: str) -> list[KVTransfer]:
        """One save of these runs (those not being saved, nor seen in the store a moment ago)."""
        if not runs:
            return []
        if not self.health.usable():
            self._stats.dropped_saves += sum(len(ids) for _, _, ids in runs)   # the store is down: recompute later
            return []
        gk = self._layouts[group_id][0]
        now = time.monotonic()
        hashes, ids, lengths, keys = [], [], [], []
        for _, run_hashes, run_ids in runs:
            key = (gk, run_hashes[-1])
            if key in self._saving or self._is_known(key, now):
                continue   # being saved, or the store had it a moment ago
            self._saving.add(key)
            keys.append(key)
            hashes += run_hashes
            ids += run_ids
            lengths.append(len(run_ids))
        if not keys:
            return []
        transfer_id = self._new_transfer_id(False, request_id, keys, len(ids))
        transfer = KVTransfer(transfer_id, request_id, group_id, ids, [], block_hashes=hashes,
                              traffic_class=traffic_class, run_lengths=lengths)
        self._queued_saves.append(transfer)
        return [transfer]

    def request_finished(self, request_id: str) -> bool:
        """Queue the request's shorter trailing runs first: their save keeps its blocks (True)."""
        for group_id, (gathered, traffic_class) in self._open.pop(request_id, {}).items():
            self._queue_saves(request_id, group_id, gathered.drain(), traffic_class)
        return super().request_finished(request_id)

    def abort_loads(self, request_id: str) -> bool:
        # Its blocks may be freed now: what it gathered to save goes with them.
        self._open.pop(request_id, None)
        return super().abort_loads(request_id)

    # ----------------------------------------------------------------------- step boundary
    def _load_finished(self, transfer: _Transfer, ok: bool) -> None:
        if ok:
            self._stats.loaded_blocks += transfer.num_blocks
            return
        self._stats.failed_loads += transfer.num_blocks
        for key in transfer.keys:
            self._known.pop(key, None)

    def _save_finished(self, transfer: _Transfer, ok: bool) -> None:
        self._saving.difference_update(transfer.keys)
        if ok:
            self._stats.saved_blocks += transfer.num_blocks
        else:
            self._stats.dropped_saves += transfer.num_blocks

    def stats(self) -> KVConnectorStats:
        stats = self._stats.copy()
        stats.store_errors = self.health.errors
        return stats

    def attach_kv_events(self, sink: KVEventSink) -> None:
        """Report the entries this side removes (found damaged by a look-up) as KV events."""
        self.backend.on_removed = report_removals(self._layouts, sink, self.backend.medium)
