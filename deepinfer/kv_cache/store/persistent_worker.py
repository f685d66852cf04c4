"""The persistent KV store tier's worker side (StoreTierWorker): the copies between the device
blocks and host memory on the step, the writer and reader threads that move entries to and from
the backend. What it does, and the scheduler side, are described in persistent.py; its loads are
persistent_loads.py's.

Saves stream through the staging buffer (staging.py) in whole runs (an entry is written from the
slots of its run's blocks at once): a step's saves are queued in order (the backlog) and their
runs staged as far as the saves' half has room; the rest stays queued, with its device blocks
held (the save is not reported finished), and is staged at a later step or poll, once the writer
freed slots. Every full block of a save is written unless the store is down or the worker
shuts down before it could be: those drops are counted (StoreWorkerStats.dropped_saves, the
kv_tier_dropped_saves_total series) and the first is logged."""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.kv_cache.connector import (
    KVConnectorWorker,
    TierKey,
    group_kv_tensors,
)
from deepinfer.kv_cache.specs import KVCacheGroup
from deepinfer.kv_cache.store import entry as entry_format
from deepinfer.kv_cache.store.backend import StoreBackend, StoreCounts, StoreHealth, StoreUnavailable
from deepinfer.kv_cache.store.entry import EntryLayout
from deepinfer.kv_cache.store.entry_io import OpResult, ProcessIO, ThreadIO
from deepinfer.kv_cache.store.host import _pages, _word_dtype
from deepinfer.kv_cache.store.layerwise import LayerwiseCopies
from deepinfer.kv_cache.store.persistent import (
    _STOP,
    DEFAULT_CLASS,
    GC_INTERVAL_S,
    _serve,
    group_layouts,
    report_removals,
)
from deepinfer.kv_cache.store.persistent_loads import StoreLoads, _Load, run_spans
from deepinfer.kv_cache.store.runs import CHUNK_BLOCKS
from deepinfer.kv_cache.store.staging import StagingBuffer, staging_shape
from deepinfer.platforms.transfer import to_device
from deepinfer.types.plan import KVConnectorMetadata, KVTransfer
from deepinfer.types.tier_stats import LatencyHistogram

if TYPE_CHECKING:
    from deepinfer.kv_cache.events import KVEventSink

logger = logging.getLogger(__name__)

COUNTS_INTERVAL_S = 2.0


@dataclass
class StoreWorkerStats:
    """The worker side's counters (the threads'): what was written, skipped, found bad."""

    written_blocks: int = 0       # blocks written to the store (in written_entries runs)
    written_entries: int = 0
    skipped_blocks: int = 0       # blocks of saves the store already held
    dropped_saves: int = 0        # blocks of saves not written: store down, write failed, shutdown
    loaded_blocks: int = 0
    failed_loads: int = 0         # load transfers reported failed
    load_timeouts: int = 0        # of those, not read within load_timeout_s
    missing_entries: int = 0      # entries (runs) gone by the time they were read
    bad_entries: dict[str, int] = field(default_factory=lambda: dict.fromkeys(entry_format.REASONS, 0))
    write_errors: int = 0
    read_errors: int = 0
    expired_entries: int = 0      # dropped by gc (retention)
    # The backend's cheap view (entries, bytes, drops), refreshed every COUNTS_INTERVAL_S.
    counts: StoreCounts = field(default_factory=StoreCounts)
    write_latency: LatencyHistogram = field(default_factory=LatencyHistogram)   # staged -> written

    @property
    def corrupt_entries(self) -> int:
        return sum(self.bad_entries.values())

    def copy(self) -> StoreWorkerStats:
        out = StoreWorkerStats(**vars(self))
        out.bad_entries = dict(self.bad_entries)
        out.counts = dataclasses.replace(self.counts)
        out.write_latency = self.write_latency.copy()
        return out


@dataclass
class _Staged:
    """Runs of saves of one group and traffic class staged together, each run's blocks copied
    into staging slots (runs[i] = (save, the run's first block in it, the run's slots))."""

    group_id: int
    traffic_class: str
    runs: list[tuple[KVTransfer, int, list[int]]]
    event: torch.cuda.Event | None
    staged_at: float = field(default_factory=time.monotonic)

    @property
    def slots(self) -> list[int]:
        return [slot for _, _, slots in self.runs for slot in slots]

    def entries(self):
        """(the run's key hash: its last block's, the run's block hashes, its slots) of every run."""
        for transfer, start, slots in self.runs:
            hashes = transfer.block_hashes[start:start + len(slots)]
            yield hashes[-1], hashes, slots

    def block_ids(self) -> list[int]:
        return [b for transfer, start, slots in self.runs for b in transfer.device_block_ids[start:start + len(slots)]]


class StoreTierWorker(StoreLoads, KVConnectorWorker):
    def __init__(self, backend: StoreBackend, device: torch.device, *, load_timeout_s: float = 5.0,
                 buffer_bytes: int = 1 << 30, io_threads: int | None = None, io_process: bool | None = None,
                 flush_timeout_s: float = 10.0, backoff_s: float = 1.0, key_extra: bytes = b"",
                 durable_saves: bool = False, run_blocks: int = CHUNK_BLOCKS, layerwise: bool = False) -> None:
        self.backend = backend
        self.device = torch.device(device)
        self.load_timeout_s = load_timeout_s
        # The staging buffer (staging.py) bounds what is in flight between device and store:
        # saves waiting to be written and loads read but not yet copied in.
        self.buffer_bytes = buffer_bytes
        self.run_blocks = run_blocks   # the longest entry: each half of the buffer holds one whole
        self.staging: StagingBuffer | None = None
        self.flush_timeout_s = flush_timeout_s
        self.key_extra = key_extra
        # A save is reported finished once its copy off the device is complete (its blocks may be
        # freed then), or, with durable_saves (kv_role=prefill), once it is written to the store:
        # the scheduler then holds the request's answer until the decode side can load its KV.
        self.durable_saves = durable_saves
        self.health = StoreHealth(backend.url, backoff_s)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._stats = StoreWorkerStats()
        self._lock = threading.Lock()
        self._layouts: dict[int, tuple[bytes, EntryLayout]] = {}
        self._words: dict[int, torch.dtype] = {}
        self._group_pages: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._deferred_saves: list[KVTransfer] = []
        # Saves not fully staged yet, in order: [save, its first run not staged]. The step
        # thread's (after_forward, finished_transfers) and, once it is idle, flush's.
        self._backlog: collections.deque[list] = collections.deque()
        self._save_left: dict[int, int] = {}   # blocks of each save not staged-and-done yet
        self._drop_logged = False
        self._staging: collections.deque[_Staged] = collections.deque()   # copies not complete yet
        # Runs staged, not written yet: (their slots, the copy's event on CUDA); a load may read
        # them from there.
        self._pending: dict[TierKey, tuple[list[int], torch.cuda.Event | None]] = {}
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._loads: collections.deque[_Load] = collections.deque()
        # Copies into device blocks queued on the side stream: (the load reported when it is done,
        # or None; the slots it frees; its event; finished or failed)
        self._copies: collections.deque[tuple[int | None, list[int], torch.cuda.Event, bool]] = collections.deque()
        # kv_store_layerwise_load: a load's last runs are copied in layer by layer beside the
        # forward that follows its hand-over (layerwise.py); None: copied in whole first.
        self._layerwise = (LayerwiseCopies(self.device, self._stream, self._rows,
                                           lambda slots: self.staging.free(slots, "load")) if layerwise else None)
        # The writer and reader threads hand a transfer's entries to the data path (entry_io.py):
        # in a process of its own on a GPU (the step is host-bound Python there), on threads of
        # this process on the CPU (whose cores belong to the forward, so fewer of them).
        self._io_threads = io_threads or (min(8, os.cpu_count() or 1) if self._cuda else 2)
        self._io_process = self._cuda if io_process is None else io_process
        if self._io_process and backend.reopen_args() is None:
            self._io_process = False   # an injected clock cannot follow the store into a child
        self._io: ThreadIO | ProcessIO | None = None
        self._done: list[int] = []
        self._failed: list[int] = []
        self._idle = threading.Condition(self._lock)
        self._unwritten = 0                    # staged batches (_Staged) queued or being written
        self._closed = False
        self._closing_deadline: float | None = None
        self._last_gc = time.monotonic()
        self._last_counts = -COUNTS_INTERVAL_S
        self.events: KVEventSink | None = None   # KV events of what this instance writes and removes
        self._report_removed = None
        # The threads hold the worker weakly: an engine dropped without shutdown still lets its
        # KV tensors go (the threads notice within THREAD_POLL_S and end).
        ref = weakref.ref(self)
        self._writer = threading.Thread(target=_serve, args=(ref, self._writes, "_on_write"),
                                        name="kv-store-writer", daemon=True)
        self._reader = threading.Thread(target=_serve, args=(ref, self._reads, "_on_read"),
                                        name="kv-store-reader", daemon=True)
        self._writer.start()
        self._reader.start()
        atexit.register(lambda: (w := ref()) is not None and w.close())

    # --------------------------------------------------------------------------- registration
    def register_kv_caches(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                           groups: Sequence[KVCacheGroup], block_size: int) -> None:
        self._layouts = group_layouts(groups, block_size, self.key_extra)
        by_id = {g.group_id: g for g in groups}
        for group_id, (_, layout) in self._layouts.items():
            word = _word_dtype(layout.page_bytes)
            self._words[group_id] = word
            rows = by_id[group_id].spec.rows_per_block(block_size)
            # Per layer, its tensors' pages: (K, V), or (KV,) where they are one tensor.
            self._group_pages[group_id] = [(_pages(k, rows, word), _pages(v, rows, word))[:layout.tensors]
                                           for k, v in group_kv_tensors(kv_caches, groups, by_id[group_id])]
        if self._layerwise is not None:
            self._layerwise.register({g: self._group_pages[g] for g in self._layouts},
                                     {g: by_id[g].layer_ids for g in self._layouts})
        if self._layouts:
            shape = staging_shape([layout.payload_bytes for _, layout in self._layouts.values()], self.buffer_bytes,
                                  2 * self.run_blocks)
            self.staging = StagingBuffer(*shape, self.device, shared=self._io_process)
            if self._io_process:
                self._io = ProcessIO(self.backend.reopen_args(), self.staging.fd, shape, self._io_threads)
            else:
                self._io = ThreadIO(self.backend, self.staging.host.numpy(), self._io_threads)
        logger.info("KV store tier: %s, groups %s, staging %d blocks", self.backend.url, sorted(self._layouts),
                    self.staging.num_slots if self.staging else 0)

    def _rows(self, group_id: int, device_side: bool = False) -> torch.Tensor:
        """The staging buffer as [slots, layers, tensors, words] of this group (its host side,
        or the device view of the mapped memory)."""
        layout = self._layouts[group_id][1]
        view = self.staging.device_view if device_side else self.staging.host
        return self.staging.rows(view, layout.payload_bytes, self._words[group_id], layout.num_layers, layout.tensors)

    def stats(self) -> StoreWorkerStats:
        with self._lock:
            return self._stats.copy()

    def attach_kv_events(self, sink: KVEventSink) -> None:
        """Report entries written (BlockStored) and removed (gc, capacity, corrupt) as KV events."""
        self.events = sink
        self._report_removed = report_removals(self._layouts, sink, self.backend.medium)

    # ------------------------------------------------------------------------------ the step
    def start_transfers(self, meta: KVConnectorMetadata) -> None:
        now = time.monotonic()
        for transfer in meta.loads:
            load = _Load(transfer, now + self.load_timeout_s)
            self._loads.append(load)
            self._reads.put(load)
        self._deferred_saves.extend(meta.saves)

    # ------------------------------------------------------------------ layer-wise loads
    @property
    def has_layer_loads(self) -> bool:
        return bool(self._layerwise)

    def wait_for_layer_load(self, layer_id: int) -> None:
        if self._layerwise:
            self._layerwise.wait_layer(layer_id)

    def wait_for_loads(self) -> None:
        if self._layerwise:
            self._layerwise.wait_all()

    def after_forward(self) -> None:
        # The saves below may gather blocks a layer-wise load still copies (a run completed by
        # blocks of a prefix hit): on the CPU those copies are made first (on CUDA the side
        # stream orders them already; the compute stream's wait is harmless).
        self.wait_for_loads()
        saves, self._deferred_saves = self._deferred_saves, []
        if saves:
            with self._lock:
                for transfer in saves:
                    self._save_left[transfer.transfer_id] = len(transfer.device_block_ids)
            self._backlog.extend([transfer, 0] for transfer in saves)
        self._stage_backlog()

    def _stage_backlog(self) -> None:
        """Stage queued saves, in order, run by run, as far as the saves' half of the buffer has
        room; the rest waits for the writer to free slots. One gather, one copy off the device and
        one write call per group and class, not per save: at a few dozen saves a step (a run
        completing in each of many decoding requests) the per-save kernel launches were the
        store's cost on the step (docs/benchmarks/design-measurements.md#kv-store-saves-batched-per-step)."""
        if not self._backlog:
            return
        usable = self.health.usable()
        batches: dict[tuple[int, str], list[tuple[KVTransfer, int, list[int]]]] = {}
        while self._backlog:
            transfer, run = self._backlog[0]
            spans = run_spans(transfer)
            if not usable:   # the store is down: dropped, the device blocks free at once
                self._backlog.popleft()
                n = len(transfer.device_block_ids) - spans[run][0]
                self._dropped(n, "the store is down")
                self._blocks_done(transfer.transfer_id, n)
                continue
            batch = batches.setdefault((transfer.group_id, transfer.traffic_class or DEFAULT_CLASS), [])
            while run < len(spans):
                start, length = spans[run]
                slots = self.staging.take(length, "save")   # a run whole, or not yet
                if not slots:
                    break
                batch.append((transfer, start, slots))
                run += 1
            if run < len(spans):
                self._backlog[0][1] = run
                break
            self._backlog.popleft()
        batches = {k: v for k, v in batches.items() if v}
        if not batches:
            return
        if self._cuda:   # behind the forward that wrote the blocks
            queued = torch.cuda.Event()
            queued.record()
            self._stream.wait_event(queued)
        for (group_id, traffic_class), runs in batches.items():
            self._stage(group_id, traffic_class, runs)

    def _stage(self, group_id: int, traffic_class: str, runs: list[tuple[KVTransfer, int, list[int]]]) -> None:
        """Copy these runs of saves' blocks device -> their staging slots (the only part on the step)."""
        staged = _Staged(group_id, traffic_class, runs, None)
        pages = self._group_pages[group_id]
        if self._cuda:
            with torch.cuda.stream(self._stream):
                self._gather(group_id, pages, staged.block_ids(), staged.slots)
                staged.event = torch.cuda.Event()
                staged.event.record(self._stream)
        else:
            self._gather(group_id, pages, staged.block_ids(), staged.slots)
        gk = self._layouts[group_id][0]
        with self._lock:
            for key_hash, _, slots in staged.entries():
                self._pending[(gk, key_hash)] = (slots, staged.event)
            self._unwritten += 1
        if not self.durable_saves:
            self._staging.append(staged)
        self._writes.put(staged)

    def _blocks_done(self, transfer_id: int, n: int) -> None:
        """n blocks of a save are off the device (copied, or dropped); the save is finished with
        its last (durable_saves: written, or dropped)."""
        with self._lock:
            left = self._save_left.get(transfer_id, 0) - n
            if left > 0:
                self._save_left[transfer_id] = left
                return
            self._save_left.pop(transfer_id, None)
            self._done.append(transfer_id)

    def _dropped(self, n: int, why: str) -> None:
        """n blocks of saves that will not be written: counted, the first time logged."""
        with self._lock:
            self._stats.dropped_saves += n
            first, self._drop_logged = not self._drop_logged, True
        if first:
            logger.warning("KV store %s: %d block(s) not saved (%s); such drops are counted in "
                           "kv_tier_dropped_saves_total and not logged again", self.backend.url, n, why)

    def _gather(self, group_id: int, pages, block_ids: Sequence[int], slots: list[int]) -> None:
        """Device blocks -> staging slots. On CUDA the blocks are gathered in device memory, then
        each run of consecutive slots is one asynchronous copy to the page-locked host rows: the
        copy engine moves them, not the SMs the forward needs (measured on the GPU with no store
        hits, every block written: the store took a clearly larger share of offline throughput
        with index kernels writing the mapped memory over the bus than with the copy engine;
        docs/benchmarks/design-measurements.md#kv-store-saves-by-the-copy-engine).
        Where the rows do not count as page-locked (staging.dma False) the kernels write the
        device view."""
        blocks = to_device(block_ids, self.device, torch.long)
        if not self._cuda or not self.staging.dma:
            rows = self._rows(group_id, device_side=self._cuda)
            slot_ids = to_device(slots, self.device, torch.long)
            for layer, tensors in enumerate(pages):
                for t, page in enumerate(tensors):
                    rows[:, layer, t].index_copy_(0, slot_ids, page.index_select(0, blocks))
            return
        rows = self._rows(group_id)
        gathered = torch.stack([torch.stack([page.index_select(0, blocks) for page in tensors], 1)
                                for tensors in pages], 1)               # [blocks, layers, tensors, words]
        for i, first, n in self.staging.runs(slots):
            rows[first:first + n].copy_(gathered[i:i + n], non_blocking=True)

    def finished_transfers(self) -> list[int]:
        self._stage_backlog()   # slots the writer freed since
        while self._staging and (self._staging[0].event is None or self._staging[0].event.query()):
            for transfer, _, slots in self._staging.popleft().runs:
                self._blocks_done(transfer.transfer_id, len(slots))
        self._finish_loads()
        if self._layerwise is not None:
            self._layerwise.poll()
        done: list[int] = []
        self._finished_copies(done)
        with self._lock:
            done.extend(self._done)
            self._done = []
        return done

    def failed_transfers(self) -> list[int]:
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    # ------------------------------------------------------------------------------ threads
    def _apply(self, result: OpResult, what: str) -> None:
        """An op's counts into the stats, its store failure into health, its removals into events."""
        if result.unavailable is not None:
            self.health.failed(StoreUnavailable(result.unavailable), what)
        else:
            self.health.succeeded()
        with self._lock:
            stats = self._stats
            stats.written_blocks += result.written_blocks
            stats.written_entries += len(result.written)
            stats.skipped_blocks += result.skipped
            stats.missing_entries += result.missing
            stats.read_errors += result.read_errors
            stats.write_errors += result.write_errors
            for reason, n in result.bad.items():
                stats.bad_entries[reason] += n
        if result.dropped:
            self._dropped(result.dropped, result.unavailable or "the store refused the write")
        if result.removed and self._report_removed is not None:
            self._report_removed(result.removed)

    def _on_write(self, staged: _Staged | None) -> None:
        if staged is not None:   # None: an idle tick
            try:
                self._write(staged)
            except Exception:   # never let the thread die
                logger.exception("KV store write failed")
            finally:
                self._written(staged)
        if self._io is None:
            return
        if time.monotonic() - self._last_gc >= GC_INTERVAL_S:
            self._last_gc = time.monotonic()
            expired, removed = self.health.call("gc", lambda: self._io.call("gc"), (0, []))
            with self._lock:
                self._stats.expired_entries += expired
            if removed and self._report_removed is not None:
                self._report_removed(removed)
        if time.monotonic() - self._last_counts >= COUNTS_INTERVAL_S:
            self._last_counts = time.monotonic()
            counts = self.health.call("counts", lambda: self._io.call("counts"), None)
            if counts is not None:
                with self._lock:
                    self._stats.counts = counts

    def _write(self, staged: _Staged) -> None:
        if staged.event is not None:
            staged.event.synchronize()
        slots = staged.slots
        if self._closing_deadline is not None and time.monotonic() > self._closing_deadline:
            self._dropped(len(slots), "shutting down: not written within the flush timeout")
            return
        gk, layout = self._layouts[staged.group_id]
        runs = list(staged.entries())
        if not self.health.usable():
            self._dropped(len(slots), "the store is down")
            return
        try:
            result = self._io.call("write", [(gk, key_hash) for key_hash, _, _ in runs],
                                   [run_slots for _, _, run_slots in runs], layout, staged.traffic_class)
        except StoreUnavailable as exc:   # the I/O process is gone
            result = OpResult(unavailable=str(exc), dropped=len(slots), write_errors=1)
        self._apply(result, "write")
        if result.written:
            if self.events is not None:   # every block of a run written: the router matches prefixes by block
                hashes = {key_hash: run_hashes for key_hash, run_hashes, _ in runs}
                self.events.stored([h for key in result.written for h in hashes[key[1]]], self.backend.medium,
                                   staged.group_id)
            with self._lock:
                self._stats.write_latency.observe(time.monotonic() - staged.staged_at)

    def _written(self, staged: _Staged) -> None:
        gk = self._layouts[staged.group_id][0]
        with self._lock:
            for key_hash, _, slots in staged.entries():
                entry = self._pending.get((gk, key_hash))
                if entry is not None and entry[0] is slots:
                    del self._pending[(gk, key_hash)]
            self._unwritten -= 1
            self._idle.notify_all()
        if self.durable_saves:   # written, or dropped (the decode side then recomputes)
            for transfer, _, slots in staged.runs:
                self._blocks_done(transfer.transfer_id, len(slots))
        self.staging.free(staged.slots, "save")

    # ---------------------------------------------------------------------------- shutdown
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every save is staged and written (or dropped); False if `timeout_s` passed
        first. Called by the step thread, or while it is idle (it stages what is queued)."""
        deadline = time.monotonic() + (self.flush_timeout_s if timeout_s is None else timeout_s)
        while True:
            self._stage_backlog()
            with self._lock:
                if not self._unwritten and not self._backlog:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # Woken by every write done; queued saves wait for the slots those free.
                self._idle.wait(min(left, 0.05) if self._backlog else left)

    def wait_all(self) -> None:
        self.after_forward()   # (layer-wise copies included)
        if self._stream is not None:
            self._stream.synchronize()
        self._finish_loads(wait=True)
        if self._stream is not None:
            self._stream.synchronize()
        self.flush()

    def close(self, timeout_s: float | None = None) -> None:
        """Flush queued writes within `timeout_s` (default flush_timeout_s; what is left then is
        dropped, counted), stop the threads, close the backend. Idempotent."""
        if self._closed:
            return
        self._closed = True
        timeout = self.flush_timeout_s if timeout_s is None else timeout_s
        self.after_forward()
        if self._stream is not None:
            self._stream.synchronize()
        self._closing_deadline = time.monotonic() + timeout
        if not self.flush(timeout):
            logger.warning("KV store %s: writes still pending after %.1f s at shutdown; dropped",
                           self.backend.url, timeout)
            while self._backlog:
                transfer, run = self._backlog.popleft()
                self._dropped(len(transfer.device_block_ids) - run_spans(transfer)[run][0], "shutting down")
        self._writes.put(_STOP)
        self._reads.put(_STOP)
        self._writer.join(1.0)
        self._reader.join(1.0)
        if self._io is not None:
            self._io.close()
        if self.staging is not None:
            self.staging.close()
        self.backend.close()
