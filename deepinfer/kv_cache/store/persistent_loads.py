"""The persistent store worker's loads (StoreTierWorker's reader side; persistent_worker.py holds
the rest): entries (runs of blocks) read and checked into the loads' half of the staging buffer,
then copied into the load's device blocks on the step.

A load is read run by run, several runs in flight, so a prefix of any length loads through a
buffer of any size (each half holds at least two runs, staging.py) and its copies to the device
overlap its reads: the reader thread takes a run's slots (waiting for the step to free earlier
runs' slots), hands the run to the I/O threads (one call each: a readv straight into its slots,
then its checks) and goes on to the next; each run that lands is handed over (load.pieces), and
the step thread copies every run handed over into its device blocks when it polls
(finished_transfers), freeing its slots once that copy is done. The blocks of a run the load
does not need (its first run's blocks already on the device, its last run's past the hit) are
read with it, checked with it, and not copied. The load is reported finished once all its runs
are copied in, or failed (the request recomputes) when an entry is missing or bad, the store is
down, or no run landed within load_timeout_s of the last one.

With kv_store_layerwise_load the runs that land stay in staging while the reader still finds
room there, and once every run is read and checked the load is handed over (_hand_over): it is
reported finished at once and its runs still in staging are copied in layer by layer beside the
next forward (layerwise.py). A bad run fails the load before that, as on the plain path.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from deepinfer.kv_cache.store.backend import StoreUnavailable
from deepinfer.kv_cache.store.entry_io import OpResult
from deepinfer.kv_cache.store.persistent import DEFAULT_CLASS
from deepinfer.platforms.transfer import to_device
from deepinfer.types.plan import SKIP_BLOCK, KVTransfer

logger = logging.getLogger(__name__)


def run_spans(transfer: KVTransfer) -> list[tuple[int, int]]:
    """(first block, blocks) of each entry of a persistent store's transfer, in order."""
    spans, start = [], 0
    for length in transfer.run_lengths:
        spans.append((start, length))
        start += length
    return spans


@dataclass
class _Load:
    transfer: KVTransfer
    deadline: float                       # pushed back by every run read
    done: threading.Event = field(default_factory=threading.Event)
    # Runs read and checked, not copied in yet: (first block, its staging slots). Taken under
    # the worker's lock, by the step thread (to copy them in) or by whoever drops the load.
    pieces: collections.deque = field(default_factory=collections.deque)
    error: str | None = None
    abandoned: bool = False               # timed out: the reader stops and frees what it holds
    in_flight: int = 0                    # runs handed to the I/O threads, not landed yet


class StoreLoads:
    """The load half of StoreTierWorker (a base class of it: the attributes used here are the
    worker's, set up in its __init__ and register_kv_caches)."""

    # ------------------------------------------------------------------------------ the step
    def _finish_loads(self, wait: bool = False) -> None:
        """Copy in the pieces read so far; report the loads whose reads ended (in order)."""
        while self._loads:
            load = self._loads[0]
            if self._copies_now(load, wait):
                self._copy_pieces(load)
            while wait and not load.done.is_set() and time.monotonic() < load.deadline:
                load.done.wait(0.005)
                self._copy_pieces(load)   # the reader may be waiting for these pieces' slots
                self._free_copied_slots()   # (on CUDA they come free once their copies are done)
            if not load.done.is_set():
                if time.monotonic() < load.deadline:
                    return   # in order: later loads wait behind this one
                with self._lock:
                    load.abandoned = True
                    self._stats.load_timeouts += 1
                load.error = load.error or f"no entry read within {self.load_timeout_s} s"
            handed_over = self._hand_over(load, wait)
            if not handed_over:
                self._copy_pieces(load)
            self._loads.popleft()
            transfer = load.transfer
            if load.error is not None:
                self._drop_pieces(load)
                logger.debug("KV store load %d failed: %s", transfer.transfer_id, load.error)
                with self._lock:
                    self._stats.failed_loads += 1
                self._report_load(transfer.transfer_id, False)
                continue
            with self._lock:
                self._stats.loaded_blocks += sum(b != SKIP_BLOCK for b in transfer.device_block_ids)
                if handed_over:   # finished now: the forwards that follow wait for its copies, layer by layer
                    self._done.append(transfer.transfer_id)
            if not handed_over:
                self._report_load(transfer.transfer_id, True)

    def _copies_now(self, load: _Load, wait: bool) -> bool:
        """Whether the runs of a load that landed so far are copied in whole now. Layer-wise
        loads keep them in staging for the hand-over while the reader still finds room for a
        run there; once it might not, they are copied in (a long prefix streams through)."""
        if self._layerwise is None or wait:
            return True
        return not load.done.is_set() and self.staging.room("load") < self.run_blocks

    def _hand_over(self, load: _Load, wait: bool) -> bool:
        """kv_store_layerwise_load: once every run of the load is read and checked (the reader
        ended without an error), give the runs still in staging to the layer-wise copies
        (layerwise.py) instead of copying them in whole. Never while waiting (wait_all)."""
        if self._layerwise is None or wait or not load.done.is_set() or load.error is not None:
            return False
        with self._lock:
            pieces, load.pieces = list(load.pieces), collections.deque()
        transfer, block_ids, slots = load.transfer, [], []
        for start, piece_slots in pieces:
            for b, slot in zip(transfer.device_block_ids[start:start + len(piece_slots)], piece_slots):
                if b == SKIP_BLOCK:   # read with its run for its check, not used here
                    self.staging.free([slot], "load")
                else:
                    block_ids.append(b)
                    slots.append(slot)
        self._layerwise.add(transfer.group_id, block_ids, slots)
        return True

    def _report_load(self, transfer_id: int, ok: bool) -> None:
        """Finished or failed, once every copy queued into its blocks is done (on CUDA a failed
        load's copies must land before the blocks are recomputed)."""
        if self._cuda:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._copies.append((transfer_id, [], event, ok))
            return
        with self._lock:
            (self._done if ok else self._failed).append(transfer_id)

    def _copy_pieces(self, load: _Load) -> None:
        while True:
            with self._lock:
                if not load.pieces:
                    return
                start, slots = load.pieces.popleft()
            if load.error is not None:
                self.staging.free(slots, "load")
            else:
                self._copy_in(load.transfer, start, slots)

    def _drop_pieces(self, load: _Load) -> None:
        with self._lock:
            pieces, load.pieces = list(load.pieces), collections.deque()
        for _, slots in pieces:
            self.staging.free(slots, "load")

    def _copy_in(self, transfer: KVTransfer, start: int, slots: list[int]) -> None:
        """Staging slots -> the run's device blocks (those the load writes); the slots are freed
        once the copy is done."""
        if self._layerwise and not self._cuda:   # a block loaded twice ends with the later load's bytes
            self._layerwise.wait_all()
        pages = self._group_pages[transfer.group_id]
        wanted = [(b, slot) for b, slot in zip(transfer.device_block_ids[start:start + len(slots)], slots)
                  if b != SKIP_BLOCK]
        if not wanted:
            self.staging.free(slots, "load")
            return
        block_ids, sources = [b for b, _ in wanted], [slot for _, slot in wanted]
        if self._cuda:
            queued = torch.cuda.Event()
            queued.record()
            self._stream.wait_event(queued)
            with torch.cuda.stream(self._stream):
                self._scatter(transfer.group_id, pages, block_ids, sources)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._copies.append((None, slots, event, True))
        else:
            self._scatter(transfer.group_id, pages, block_ids, sources)
            self.staging.free(slots, "load")

    def _free_copied_slots(self) -> None:
        """CUDA: the slots of the copies done so far back to the reader while the step waits for
        a load (wait_all); the loads those copies finish are reported by the next poll."""
        done: list[int] = []
        self._finished_copies(done)
        with self._lock:
            self._done.extend(done)

    def _finished_copies(self, done: list[int]) -> None:
        """CUDA: free the slots of copies that completed; loads whose last copy did are reported."""
        while self._copies and self._copies[0][2].query():
            transfer_id, slots, _, ok = self._copies.popleft()
            if slots:
                self.staging.free(slots, "load")
            if transfer_id is not None:
                if ok:
                    done.append(transfer_id)
                else:
                    with self._lock:
                        self._failed.append(transfer_id)

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
        for layer, tensors in enumerate(pages):
            for t, page in enumerate(tensors):
                page.index_copy_(0, blocks, src[:, layer, t])

    # ------------------------------------------------------------------------- reader thread
    def _on_read(self, load: _Load | None) -> None:
        if load is None:   # idle tick
            return
        try:
            self._read(load)
        except Exception as exc:   # never let the thread die: the load fails, the request recomputes
            load.error = f"{type(exc).__name__}: {exc}"
        finally:
            if load.abandoned or load.error is not None:   # nobody will copy the rest in
                self._drop_pieces(load)
            load.done.set()

    def _read(self, load: _Load) -> None:
        """Hand the load's runs to the I/O threads one by one, each into staging slots of its
        own, as long as slots come free within the deadline; wait until every run handed over
        has landed (or failed): load.pieces then holds all that will come."""
        transfer = load.transfer
        gk, layout = self._layouts[transfer.group_id]
        landed = threading.Condition(self._lock)
        try:
            for start, length in run_spans(transfer):
                if load.error is not None or load.abandoned:
                    return
                slots = self.staging.take(length, "load", wait_s=max(0.0, load.deadline - time.monotonic()))
                if not slots:
                    load.error = f"the staging buffer had no room for a run of {length} blocks within {self.load_timeout_s} s"
                    return
                key = (gk, transfer.block_hashes[start + length - 1])
                try:
                    future = self._start_run(key, slots, layout, transfer.traffic_class)
                except BaseException:
                    self.staging.free(slots, "load")
                    raise
                if future is None:
                    self.staging.free(slots, "load")
                    load.error = "the store is down"
                    return
                with self._lock:
                    load.in_flight += 1
                future.add_done_callback(lambda f, start=start, slots=slots: self._run_landed(load, start, slots, f, landed))
        finally:
            with self._lock:   # the callbacks, not the futures' waiters, hand the runs over
                landed.wait_for(lambda: load.in_flight == 0)

    def _start_run(self, key, slots: list[int], layout, traffic_class: str | None) -> Future | None:
        """One run into `slots`: from its save's slots when it is staged and not written yet,
        else read from the store (a future of the read's OpResult); None: the store is down."""
        with self._lock:
            staged = self._pending.get(key)
        if staged is not None:
            if staged[1] is not None:   # its copy off the device must be complete
                staged[1].synchronize()
            host, size = self.staging.host, layout.payload_bytes
            with self._lock:   # unless written (and its slots freed) since
                if self._pending.get(key) is staged:
                    for src, dst in zip(staged[0], slots):
                        host[dst, :size] = host[src, :size]
                    done: Future = Future()
                    done.set_result(OpResult())
                    return done
        if not self.health.usable():
            return None
        return self._io.submit("read", [key], [slots], layout, traffic_class or DEFAULT_CLASS)

    def _run_landed(self, load: _Load, start: int, slots: list[int], future: Future,
                    landed: threading.Condition) -> None:
        """A run's read ended (an I/O thread, or the reader for a staged run): hand it over, or
        fail the load and free its slots."""
        try:
            result = future.result()
        except StoreUnavailable as exc:   # the I/O process is gone
            result = OpResult(error=str(exc), unavailable=str(exc), read_errors=1)
        except Exception as exc:   # noqa: BLE001  (never lose a run's slots: the load fails)
            result = OpResult(error=f"{type(exc).__name__}: {exc}", read_errors=1)
        self._apply(result, "read")
        with self._lock:
            keep = result.error is None and load.error is None and not load.abandoned
            if keep:
                load.pieces.append((start, slots))
                load.deadline = time.monotonic() + self.load_timeout_s
            elif result.error is not None and load.error is None:
                load.error = result.error
        if not keep:
            self.staging.free(slots, "load")
        with self._lock:
            load.in_flight -= 1
            landed.notify_all()
