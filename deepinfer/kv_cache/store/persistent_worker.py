"""The persistent KV store tier's worker side (StoreTierWorker): the copies between the device
blocks and host memory on the step, the writer and reader threads that move entries to and from
the backend. What it does, and the scheduler side, are described in persistent.py."""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.plan import KVConnectorMetadata, KVTransfer
from deepinfer.kv_cache.connector import (
    KVConnectorWorker,
    TierKey,
    group_kv_tensors,
)
from deepinfer.kv_cache.specs import KVCacheGroup
from deepinfer.kv_cache.store import entry as entry_format
from deepinfer.kv_cache.store.backend import PRESENT, StoreBackend, StoreCounts, StoreHealth, StoreUnavailable
from deepinfer.kv_cache.store.entry import EntryError, EntryLayout
from deepinfer.kv_cache.store.host import _pages, _word_dtype
from deepinfer.kv_cache.store.persistent import (
    _STOP,
    DEFAULT_CLASS,
    GC_INTERVAL_S,
    _serve,
    group_layouts,
    report_removals,
)
from deepinfer.kv_cache.tier_stats import LatencyHistogram
from deepinfer.platforms.transfer import to_device

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
    """Blocks of one save, on the host: [blocks, layers, 2, page words]."""

    transfer: KVTransfer
    host: torch.Tensor
    event: torch.cuda.Event | None
    nbytes: int
    staged_at: float = field(default_factory=time.monotonic)


@dataclass
class _Load:
    transfer: KVTransfer
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    host: torch.Tensor | None = None     # [blocks, layers, 2, words] once read and checked
    error: str | None = None
    abandoned: bool = False              # timed out: the reader's result is dropped


class StoreTierWorker(KVConnectorWorker):
    def __init__(self, backend: StoreBackend, device: torch.device, *, load_timeout_s: float = 5.0,
                 max_pending_bytes: int = 1 << 30, flush_timeout_s: float = 10.0, backoff_s: float = 1.0,
                 key_extra: bytes = b"", durable_saves: bool = False) -> None:
        self.backend = backend
        self.device = torch.device(device)
        self.load_timeout_s = load_timeout_s
        self.max_pending_bytes = max_pending_bytes
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
        # Staged, not written yet: (host blocks, row, the copy's event on CUDA)
        self._pending: dict[TierKey, tuple[torch.Tensor, int, torch.cuda.Event | None]] = {}
        self._pending_bytes = 0
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._loads: collections.deque[_Load] = collections.deque()
        self._copies: collections.deque[tuple[int, torch.cuda.Event]] = collections.deque()
        self._done: list[int] = []
        self._failed: list[int] = []
        self._idle = threading.Condition(self._lock)
        self._unwritten = 0                    # staged saves queued or being written
        self._closed = False
        self._closing_deadline: float | None = None
        self._last_gc = time.monotonic()
        self._last_counts = -COUNTS_INTERVAL_S
        self.events: KVEventSink | None = None   # KV events of what this instance writes and removes
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
        logger.info("KV store tier: %s, groups %s", self.backend.url, sorted(self._layouts))

    def stats(self) -> StoreWorkerStats:
        with self._lock:
            return self._stats.copy()

    def attach_kv_events(self, sink: KVEventSink) -> None:
        """Report entries written (BlockStored) and removed (gc, capacity, corrupt) as KV events."""
        self.events = sink
        self.backend.on_removed = report_removals(self._layouts, sink, self.backend.medium)

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
        for transfer in saves:
            self._stage(transfer)

    def _stage(self, transfer: KVTransfer) -> None:
        """Copy a save's blocks device -> host (the only part on the step)."""
        layout = self._layouts[transfer.group_id][1]
        nbytes = len(transfer.device_block_ids) * layout.payload_bytes
        with self._lock:
            full = self._pending_bytes + nbytes > self.max_pending_bytes
            if full or not self.health.usable():
                self._stats.dropped_saves += len(transfer.device_block_ids)
                # Reported finished (its device blocks are free), never written.
                self._done.append(transfer.transfer_id)
                return
            self._pending_bytes += nbytes
        pages = self._group_pages[transfer.group_id]
        n = len(transfer.device_block_ids)
        if self._cuda:
            host = torch.empty((n, len(pages), 2, pages[0][0].shape[1]), dtype=self._words[transfer.group_id],
                               pin_memory=True)
            with torch.cuda.stream(self._stream):
                blocks = to_device(transfer.device_block_ids, self.device, torch.long)
                gathered = torch.stack([torch.stack([k.index_select(0, blocks), v.index_select(0, blocks)], 1)
                                        for k, v in pages], 1)
                host.copy_(gathered, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            blocks = torch.tensor(transfer.device_block_ids, dtype=torch.long)
            host = torch.stack([torch.stack([k.index_select(0, blocks), v.index_select(0, blocks)], 1)
                                for k, v in pages], 1)
            event = None
        staged = _Staged(transfer, host, event, nbytes)
        gk = self._layouts[transfer.group_id][0]
        with self._lock:
            for i, block_hash in enumerate(transfer.block_hashes):
                self._pending[(gk, block_hash)] = (host, i, event)
            self._unwritten += 1
        if not self.durable_saves:
            self._staging.append(staged)
        self._writes.put(staged)

    def finished_transfers(self) -> list[int]:
        done: list[int] = []
        with self._lock:
            done, self._done = self._done, []
        while self._staging and (self._staging[0].event is None or self._staging[0].event.query()):
            done.append(self._staging.popleft().transfer.transfer_id)
        self._finish_loads()
        while self._copies and self._copies[0][1].query():
            done.append(self._copies.popleft()[0])
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
            if load.error is not None or load.host is None:
                logger.debug("KV store load %d failed: %s", transfer.transfer_id, load.error)
                with self._lock:
                    self._stats.failed_loads += 1
                    self._failed.append(transfer.transfer_id)
                continue
            self._copy_in(transfer, load.host)
            with self._lock:
                self._stats.loaded_blocks += len(transfer.device_block_ids)

    def _copy_in(self, transfer: KVTransfer, host: torch.Tensor) -> None:
        pages = self._group_pages[transfer.group_id]
        if self._cuda:
            queued = torch.cuda.Event()
            queued.record()
            self._stream.wait_event(queued)
            with torch.cuda.stream(self._stream):
                blocks = to_device(transfer.device_block_ids, self.device, torch.long)
                src = host.pin_memory().to(self.device, non_blocking=True)
                for layer, (k, v) in enumerate(pages):
                    k.index_copy_(0, blocks, src[:, layer, 0])
                    v.index_copy_(0, blocks, src[:, layer, 1])
                event = torch.cuda.Event()
                event.record(self._stream)
            self._copies.append((transfer.transfer_id, event))
        else:
            blocks = torch.tensor(transfer.device_block_ids, dtype=torch.long)
            for layer, (k, v) in enumerate(pages):
                k.index_copy_(0, blocks, host[:, layer, 0])
                v.index_copy_(0, blocks, host[:, layer, 1])
            with self._lock:
                self._done.append(transfer.transfer_id)

    # ------------------------------------------------------------------------------ threads
    def _on_read(self, load: _Load | None) -> None:
        if load is None:   # idle tick
            return
        try:
            load.host = self._read(load)
        except Exception as exc:   # never let the thread die: the load fails, the request recomputes
            load.error = f"{type(exc).__name__}: {exc}"
        finally:
            load.done.set()

    def _read(self, load: _Load) -> torch.Tensor | None:
        transfer = load.transfer
        gk, layout = self._layouts[transfer.group_id]
        keys = [(gk, h) for h in transfer.block_hashes]
        word = self._words[transfer.group_id]
        rows: list[torch.Tensor | None] = [None] * len(keys)
        with self._lock:
            staged_rows = [(i, self._pending.get(key)) for i, key in enumerate(keys)]
        for i, staged in staged_rows:   # staged, not written yet: from host memory
            if staged is not None:
                host, row, event = staged
                if event is not None:
                    event.synchronize()
                rows[i] = host[row].clone()
        wanted = [i for i, r in enumerate(rows) if r is None]
        if wanted:
            if not self.health.usable():
                load.error = "the store is down"
                return None
            try:
                data = self.backend.get([keys[i] for i in wanted])
            except StoreUnavailable as exc:
                self.health.failed(exc, "read")
                with self._lock:
                    self._stats.read_errors += 1
                load.error = str(exc)
                return None
            self.health.succeeded()
            bad = []
            for i, raw in zip(wanted, data):
                if raw is None:
                    with self._lock:
                        self._stats.missing_entries += 1
                    load.error = "entry gone"
                    continue
                try:
                    _, payload = entry_format.decode(raw, keys[i][0], keys[i][1], layout)
                except EntryError as exc:
                    with self._lock:
                        self._stats.bad_entries[exc.reason] += 1
                    logger.warning("KV store %s: dropping a bad entry (%s)", self.backend.url, exc)
                    bad.append(keys[i])
                    load.error = str(exc)
                    continue
                rows[i] = torch.frombuffer(bytearray(payload), dtype=word).view(layout.num_layers, 2, -1)
            if bad:
                self.health.call("delete", lambda: self.backend.delete(bad), None)
            if load.error is not None:
                return None
            self.health.call("touch", lambda: self.backend.touch([keys[i] for i in wanted],
                                                                 transfer.traffic_class or DEFAULT_CLASS), None)
        if load.abandoned:
            return None
        return torch.stack(rows)

    def _on_write(self, staged: _Staged | None) -> None:
        if staged is not None:   # None: an idle tick
            try:
                self._write(staged)
            except Exception:   # never let the thread die
                logger.exception("KV store write failed")
            finally:
                self._written(staged)
        if time.monotonic() - self._last_gc >= GC_INTERVAL_S:
            self._last_gc = time.monotonic()
            expired = self.health.call("gc", self.backend.gc, 0)
            with self._lock:
                self._stats.expired_entries += expired
        if time.monotonic() - self._last_counts >= COUNTS_INTERVAL_S:
            self._last_counts = time.monotonic()
            counts = self.health.call("counts", self.backend.counts, None)
            if counts is not None:
                with self._lock:
                    self._stats.counts = counts

    def _write(self, staged: _Staged) -> None:
        if staged.event is not None:
            staged.event.synchronize()
        transfer = staged.transfer
        gk, layout = self._layouts[transfer.group_id]
        keys = [(gk, h) for h in transfer.block_hashes]
        n = len(keys)
        if self._closing_deadline is not None and time.monotonic() > self._closing_deadline:
            with self._lock:
                self._stats.dropped_saves += n
            return
        states = self.health.call("exists", lambda: self.backend.exists(keys, [layout.entry_bytes] * n), None)
        if states is None:
            with self._lock:
                self._stats.dropped_saves += n
            return
        traffic_class = transfer.traffic_class or DEFAULT_CLASS
        now = self.backend.clock()
        items = []
        host = staged.host.cpu()
        for i, (key, state) in enumerate(zip(keys, states)):
            if state == PRESENT:
                continue
            payload = host[i].contiguous().view(torch.uint8).numpy().tobytes()
            items.append((key, entry_format.encode(key[0], key[1], layout, payload, traffic_class, now),
                          traffic_class))
        skipped = n - len(items)
        if skipped:   # the store has them: this save is a use, under this request's class
            present = [key for key, state in zip(keys, states) if state == PRESENT]
            self.health.call("touch", lambda: self.backend.touch(present, traffic_class), None)
        try:
            self.backend.put(items)
        except StoreUnavailable as exc:
            self.health.failed(exc, "write")
            with self._lock:
                self._stats.write_errors += 1
                self._stats.dropped_saves += len(items)
                self._stats.skipped_blocks += skipped
            return
        self.health.succeeded()
        if self.events is not None:
            self.events.stored([key[1] for key, _, _ in items], self.backend.medium, transfer.group_id)
        with self._lock:
            self._stats.written_blocks += len(items)
            self._stats.skipped_blocks += skipped
            self._stats.write_latency.observe(time.monotonic() - staged.staged_at)

    def _written(self, staged: _Staged) -> None:
        gk = self._layouts[staged.transfer.group_id][0]
        with self._lock:
            for block_hash in staged.transfer.block_hashes:
                entry = self._pending.get((gk, block_hash))
                if entry is not None and entry[0] is staged.host:
                    del self._pending[(gk, block_hash)]
            self._pending_bytes -= staged.nbytes
            self._unwritten -= 1
            if self.durable_saves:   # written, or dropped (the decode side then recomputes)
                self._done.append(staged.transfer.transfer_id)
            self._idle.notify_all()

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
        self.backend.close()
