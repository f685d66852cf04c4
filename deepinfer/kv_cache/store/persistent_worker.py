"""The persistent KV store tier's worker side (StoreTierWorker): the copies between the device
blocks and host memory on the step, the writer and reader threads that move entries to and from
the backend. What it does, and the scheduler side, are described in persistent.py."""

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
from deepinfer.kv_cache.store.persistent import (
    _STOP,
    DEFAULT_CLASS,
    GC_INTERVAL_S,
    _serve,
    group_layouts,
    report_removals,
)
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

    written_blocks: int = 0       # entries written to the store
    skipped_blocks: int = 0       # saves the store already held
    dropped_saves: int = 0        # saves not written: queue full, store down, flush timed out
    loaded_blocks: int = 0
    failed_loads: int = 0         # load transfers reported failed
    load_timeouts: int = 0        # of those, not read within load_timeout_s
    missing_entries: int = 0      # entries gone by the time they were read
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
    """A step's saves of one group and traffic class, each save's leading blocks copied into
    staging slots (parts[i] = (save, its slots), slots[j]: block j of that save)."""

    group_id: int
    traffic_class: str
    parts: list[tuple[KVTransfer, list[int]]]
    event: torch.cuda.Event | None
    staged_at: float = field(default_factory=time.monotonic)

    @property
    def slots(self) -> list[int]:
        return [slot for _, slots in self.parts for slot in slots]

    def entries(self):
        """(block hash, slot) of every staged block."""
        for transfer, slots in self.parts:
            yield from zip(transfer.block_hashes, slots)


@dataclass
class _Load:
    transfer: KVTransfer
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    slots: list[int] | None = None       # staging slots holding the read, checked entries (block i: slots[i])
    error: str | None = None
    abandoned: bool = False              # timed out: the reader's result is dropped


class StoreTierWorker(KVConnectorWorker):
    def __init__(self, backend: StoreBackend, device: torch.device, *, load_timeout_s: float = 5.0,
                 buffer_bytes: int = 1 << 30, io_threads: int | None = None, io_process: bool | None = None,
                 flush_timeout_s: float = 10.0, backoff_s: float = 1.0, key_extra: bytes = b"",
                 durable_saves: bool = False) -> None:
        self.backend = backend
        self.device = torch.device(device)
        self.load_timeout_s = load_timeout_s
        # The staging buffer (staging.py) bounds what is in flight between device and store:
        # saves waiting to be written and loads read but not yet copied in.
        self.buffer_bytes = buffer_bytes
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
        self._staging: collections.deque[_Staged] = collections.deque()   # copies not complete yet
        # Staged, not written yet: (slot, the copy's event on CUDA); a load may read it from there.
        self._pending: dict[TierKey, tuple[int, torch.cuda.Event | None]] = {}
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._loads: collections.deque[_Load] = collections.deque()
        # Loads copied in on the side stream: (transfer id, its slots, the copy's event)
        self._copies: collections.deque[tuple[int, list[int], torch.cuda.Event]] = collections.deque()
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
            self._group_pages[group_id] = [(_pages(k, block_size, word), _pages(v, block_size, word))
                                           for k, v in group_kv_tensors(kv_caches, groups, by_id[group_id])]
        if self._layouts:
            shape = staging_shape([layout.payload_bytes for _, layout in self._layouts.values()], self.buffer_bytes)
            self.staging = StagingBuffer(*shape, self.device, shared=self._io_process)
            if self._io_process:
                self._io = ProcessIO(self.backend.reopen_args(), self.staging.fd, shape, self._io_threads)
            else:
                self._io = ThreadIO(self.backend, self.staging.host.numpy(), self._io_threads)
        logger.info("KV store tier: %s, groups %s, staging %d blocks", self.backend.url, sorted(self._layouts),
                    self.staging.num_slots if self.staging else 0)

    def _rows(self, group_id: int, device_side: bool = False) -> torch.Tensor:
        """The staging buffer as [slots, layers, 2, words] of this group (its host side, or the
        device view of the mapped memory)."""
        layout = self._layouts[group_id][1]
        view = self.staging.device_view if device_side else self.staging.host
        return self.staging.rows(view, layout.payload_bytes, self._words[group_id], layout.num_layers)

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

    def after_forward(self) -> None:
        saves, self._deferred_saves = self._deferred_saves, []
        if not saves:
            return
        if self._cuda:   # behind the forward that wrote the blocks
            queued = torch.cuda.Event()
            queued.record()
            self._stream.wait_event(queued)
        # One gather, one copy off the device and one write call per group and class for the
        # whole step, not per save: at a few dozen saves a step (a block completing in each of
        # many decoding requests) the per-save kernel launches were the store's cost on the step
        # (docs/benchmarks/design-measurements.md#kv-store-saves-batched-per-step).
        batches: dict[tuple[int, str], list[KVTransfer]] = {}
        for transfer in saves:
            batches.setdefault((transfer.group_id, transfer.traffic_class or DEFAULT_CLASS), []).append(transfer)
        for (group_id, traffic_class), transfers in batches.items():
            self._stage(group_id, traffic_class, transfers)

    def _stage(self, group_id: int, traffic_class: str, transfers: list[KVTransfer]) -> None:
        """Copy saves' blocks device -> staging slots (the only part on the step). With too few
        free slots a save's leading blocks are staged (a prefix hit needs them first), the rest
        dropped."""
        parts: list[tuple[KVTransfer, list[int]]] = []
        dropped = 0
        for transfer in transfers:
            n = len(transfer.device_block_ids)
            slots = self.staging.take(n, "save", partial=True) if self.health.usable() else []
            dropped += n - len(slots)
            if slots:
                parts.append((transfer, slots))
            else:
                with self._lock:   # reported finished (its device blocks are free), never written
                    self._done.append(transfer.transfer_id)
        if dropped:
            with self._lock:
                self._stats.dropped_saves += dropped
        if not parts:
            return
        block_ids = [b for transfer, slots in parts for b in transfer.device_block_ids[:len(slots)]]
        staged = _Staged(group_id, traffic_class, parts, None)
        pages = self._group_pages[group_id]
        if self._cuda:
            with torch.cuda.stream(self._stream):
                self._gather(group_id, pages, block_ids, staged.slots)
                staged.event = torch.cuda.Event()
                staged.event.record(self._stream)
        else:
            self._gather(group_id, pages, block_ids, staged.slots)
        gk = self._layouts[group_id][0]
        with self._lock:
            for block_hash, slot in staged.entries():
                self._pending[(gk, block_hash)] = (slot, staged.event)
            self._unwritten += 1
        if not self.durable_saves:
            self._staging.append(staged)
        self._writes.put(staged)

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
            for layer, (k, v) in enumerate(pages):
                rows[:, layer, 0].index_copy_(0, slot_ids, k.index_select(0, blocks))
                rows[:, layer, 1].index_copy_(0, slot_ids, v.index_select(0, blocks))
            return
        rows = self._rows(group_id)
        gathered = torch.stack([torch.stack([k.index_select(0, blocks), v.index_select(0, blocks)], 1)
                                for k, v in pages], 1)                   # [blocks, layers, 2, words]
        for i, first, n in self.staging.runs(slots):
            rows[first:first + n].copy_(gathered[i:i + n], non_blocking=True)

    def finished_transfers(self) -> list[int]:
        done: list[int] = []
        with self._lock:
            done, self._done = self._done, []
        while self._staging and (self._staging[0].event is None or self._staging[0].event.query()):
            done.extend(transfer.transfer_id for transfer, _ in self._staging.popleft().parts)
        self._finish_loads()
        while self._copies and self._copies[0][2].query():
            transfer_id, slots, _ = self._copies.popleft()
            self.staging.free(slots, "load")
            done.append(transfer_id)
        with self._lock:
            done.extend(self._done)
            self._done = []
        return done

    def failed_transfers(self) -> list[int]:
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def _finish_loads(self, wait: bool = False) -> None:
        """Loads whose reads completed: copy into the device blocks (or report them failed)."""
        while self._loads:
            load = self._loads[0]
            if wait:
                load.done.wait(max(0.0, load.deadline - time.monotonic()))
            if not load.done.is_set():
                if time.monotonic() < load.deadline:
                    return   # in order: later loads wait behind this one
                load.abandoned = True
                with self._lock:
                    self._stats.load_timeouts += 1
                load.error = load.error or f"not read within {self.load_timeout_s} s"
            self._loads.popleft()
            transfer = load.transfer
            slots = self._claim(load)
            if load.error is not None or slots is None:
                if slots is not None:
                    self.staging.free(slots, "load")
                logger.debug("KV store load %d failed: %s", transfer.transfer_id, load.error)
                with self._lock:
                    self._stats.failed_loads += 1
                    self._failed.append(transfer.transfer_id)
                continue
            self._copy_in(transfer, slots)
            with self._lock:
                self._stats.loaded_blocks += len(transfer.device_block_ids)

    def _claim(self, load: _Load) -> list[int] | None:
        """The load's slots, taken from it (once: the reader and the step thread both try when a
        load times out, and whoever claims them frees them)."""
        with self._lock:
            slots, load.slots = load.slots, None
        return slots

    def _copy_in(self, transfer: KVTransfer, slots: list[int]) -> None:
        """Staging slots -> the load's device blocks; the slots are freed once the copy is done."""
        pages = self._group_pages[transfer.group_id]
        if self._cuda:
            queued = torch.cuda.Event()
            queued.record()
            self._stream.wait_event(queued)
            with torch.cuda.stream(self._stream):
                self._scatter(transfer.group_id, pages, transfer.device_block_ids, slots)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._copies.append((transfer.transfer_id, slots, event))
        else:
            self._scatter(transfer.group_id, pages, transfer.device_block_ids, slots)
            self.staging.free(slots, "load")
            with self._lock:
                self._done.append(transfer.transfer_id)

    def _scatter(self, group_id: int, pages, block_ids: Sequence[int], slots: list[int]) -> None:
        """Staging slots -> device blocks: on CUDA each run of consecutive slots is one
        asynchronous copy into device memory (the copy engine), then per layer an index copy."""
        blocks = to_device(block_ids, self.device, torch.long)
        if self._cuda and self.staging.dma:
            rows = self._rows(group_id)
            src = torch.empty((len(slots), *rows.shape[1:]), dtype=rows.dtype, device=self.device)
            for i, first, n in self.staging.runs(slots):
                src[i:i + n].copy_(rows[first:first + n], non_blocking=True)
        else:
            src = self._rows(group_id, device_side=self._cuda).index_select(0, to_device(slots, self.device, torch.long))
        for layer, (k, v) in enumerate(pages):
            k.index_copy_(0, blocks, src[:, layer, 0])
            v.index_copy_(0, blocks, src[:, layer, 1])

    # ------------------------------------------------------------------------------ threads
    def _on_read(self, load: _Load | None) -> None:
        if load is None:   # idle tick
            return
        try:
            self._read(load)
        except Exception as exc:   # never let the thread die: the load fails, the request recomputes
            load.error = f"{type(exc).__name__}: {exc}"
        finally:
            if load.abandoned or load.error is not None:   # nobody will copy it in
                slots = self._claim(load)
                if slots is not None:
                    self.staging.free(slots, "load")
            load.done.set()

    def _read(self, load: _Load) -> None:
        """Read and check the load's entries into staging slots (load.slots), or set load.error."""
        transfer = load.transfer
        gk, layout = self._layouts[transfer.group_id]
        keys = [(gk, h) for h in transfer.block_hashes]
        slots = self.staging.take(len(keys), "load")
        if not slots:
            load.error = f"the staging buffer has fewer than {len(keys)} free blocks"
            return
        load.slots = slots
        with self._lock:
            staged = {i: self._pending[key] for i, key in enumerate(keys) if key in self._pending}
        for _, event in staged.values():   # their copies off the device must be complete
            if event is not None:
                event.synchronize()
        host, size = self.staging.host, layout.payload_bytes
        with self._lock:   # staged, not written yet: copied from its slot, unless written (and freed) since
            for i, (slot, event) in list(staged.items()):
                if self._pending.get(keys[i]) == (slot, event):
                    host[slots[i], :size] = host[slot, :size]
                else:
                    del staged[i]
        wanted = [i for i in range(len(keys)) if i not in staged]
        if not wanted:
            return
        if not self.health.usable():
            load.error = "the store is down"
            return
        try:
            result = self._io.call("read", [keys[i] for i in wanted], [slots[i] for i in wanted], layout,
                                   transfer.traffic_class or DEFAULT_CLASS)
        except StoreUnavailable as exc:   # the I/O process is gone
            result = OpResult(error=str(exc), unavailable=str(exc), read_errors=1)
        self._apply(result, "read")
        load.error = result.error

    def _apply(self, result: OpResult, what: str) -> None:
        """An op's counts into the stats, its store failure into health, its removals into events."""
        if result.unavailable is not None:
            self.health.failed(StoreUnavailable(result.unavailable), what)
        else:
            self.health.succeeded()
        with self._lock:
            stats = self._stats
            stats.written_blocks += len(result.written)
            stats.skipped_blocks += result.skipped
            stats.dropped_saves += result.dropped
            stats.missing_entries += result.missing
            stats.read_errors += result.read_errors
            stats.write_errors += result.write_errors
            for reason, n in result.bad.items():
                stats.bad_entries[reason] += n
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
            with self._lock:
                self._stats.dropped_saves += len(slots)
            return
        gk, layout = self._layouts[staged.group_id]
        keys = [(gk, block_hash) for block_hash, _ in staged.entries()]
        if not self.health.usable():
            with self._lock:
                self._stats.dropped_saves += len(slots)
            return
        try:
            result = self._io.call("write", keys, slots, layout, staged.traffic_class)
        except StoreUnavailable as exc:   # the I/O process is gone
            result = OpResult(unavailable=str(exc), dropped=len(slots), write_errors=1)
        self._apply(result, "write")
        if result.written:
            if self.events is not None:
                self.events.stored([key[1] for key in result.written], self.backend.medium, staged.group_id)
            with self._lock:
                self._stats.write_latency.observe(time.monotonic() - staged.staged_at)

    def _written(self, staged: _Staged) -> None:
        gk = self._layouts[staged.group_id][0]
        with self._lock:
            for block_hash, slot in staged.entries():
                entry = self._pending.get((gk, block_hash))
                if entry is not None and entry[0] == slot:
                    del self._pending[(gk, block_hash)]
            self._unwritten -= 1
            if self.durable_saves:   # written, or dropped (the decode side then recomputes)
                self._done.extend(transfer.transfer_id for transfer, _ in staged.parts)
            self._idle.notify_all()
        self.staging.free(staged.slots, "save")

    # ---------------------------------------------------------------------------- shutdown
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every staged save is written (or dropped); False if `timeout_s` passed first."""
        deadline = time.monotonic() + (self.flush_timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            while self._unwritten:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def wait_all(self) -> None:
        self.after_forward()
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
        self._writes.put(_STOP)
        self._reads.put(_STOP)
        self._writer.join(1.0)
        self._reader.join(1.0)
        if self._io is not None:
            self._io.close()
        if self.staging is not None:
            self.staging.close()
        self.backend.close()
