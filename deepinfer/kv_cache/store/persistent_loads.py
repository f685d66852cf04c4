"""The persistent store worker's loads (StoreTierWorker's reader side; persistent_worker.py holds
the rest): entries read and checked into the loads' half of the staging buffer, then copied into
the load's device blocks on the step.

A load is read in pieces of at most the loads' half of the buffer (staging.py), so a prefix of
any length loads whole through a buffer of any size: the reader thread takes a piece's slots
(waiting for the step to free earlier pieces' slots), reads into them and hands the piece over;
the step thread copies every piece handed over into its device blocks when it polls
(finished_transfers), and frees its slots once that copy is done. The load is reported finished
once all its pieces are copied in, or failed (the request recomputes) when an entry is missing
or bad, the store is down, or no piece arrived within load_timeout_s of the last one.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.kv_cache.store.backend import StoreUnavailable
from deepinfer.kv_cache.store.entry_io import OpResult
from deepinfer.kv_cache.store.persistent import DEFAULT_CLASS
from deepinfer.platforms.transfer import to_device
from deepinfer.types.plan import KVTransfer

logger = logging.getLogger(__name__)


@dataclass
class _Load:
    transfer: KVTransfer
    deadline: float                       # pushed back by every piece read
    done: threading.Event = field(default_factory=threading.Event)
    # Pieces read and checked, not copied in yet: (first block, its staging slots). Taken under
    # the worker's lock, by the step thread (to copy them in) or by whoever drops the load.
    pieces: collections.deque = field(default_factory=collections.deque)
    error: str | None = None
    abandoned: bool = False               # timed out: the reader stops and frees what it holds


class StoreLoads:
    """The load half of StoreTierWorker (a base class of it: the attributes used here are the
    worker's, set up in its __init__ and register_kv_caches)."""

    # ------------------------------------------------------------------------------ the step
    def _finish_loads(self, wait: bool = False) -> None:
        """Copy in the pieces read so far; report the loads whose reads ended (in order)."""
        while self._loads:
            load = self._loads[0]
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
                self._stats.loaded_blocks += len(transfer.device_block_ids)
            self._report_load(transfer.transfer_id, True)

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
        """Staging slots -> the piece's device blocks; the slots are freed once the copy is done."""
        pages = self._group_pages[transfer.group_id]
        block_ids = transfer.device_block_ids[start:start + len(slots)]
        if self._cuda:
            queued = torch.cuda.Event()
            queued.record()
            self._stream.wait_event(queued)
            with torch.cuda.stream(self._stream):
                self._scatter(transfer.group_id, pages, block_ids, slots)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._copies.append((None, slots, event, True))
        else:
            self._scatter(transfer.group_id, pages, block_ids, slots)
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
        """Read and check the load's entries, piece by piece, into staging slots handed to the
        step thread (load.pieces), or set load.error."""
        transfer = load.transfer
        gk, layout = self._layouts[transfer.group_id]
        keys = [(gk, h) for h in transfer.block_hashes]
        piece = self.staging.quota["load"]
        for start in range(0, len(keys), piece):
            n = min(piece, len(keys) - start)
            slots = self.staging.take(n, "load", wait_s=max(0.0, load.deadline - time.monotonic()))
            if not slots:
                load.error = f"the staging buffer had no room for {n} blocks within {self.load_timeout_s} s"
                return
            try:
                load.error = self._read_piece(keys[start:start + n], slots, layout, transfer.traffic_class)
            except BaseException:
                self.staging.free(slots, "load")
                raise
            with self._lock:
                keep = load.error is None and not load.abandoned
                if keep:
                    load.pieces.append((start, slots))
            if not keep:
                self.staging.free(slots, "load")
                return
            load.deadline = time.monotonic() + self.load_timeout_s

    def _read_piece(self, keys: list, slots: list[int], layout, traffic_class: str | None) -> str | None:
        """Entries `keys` into `slots`; None, or why not. A block staged by a save and not written
        yet is copied from its save slot."""
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
            return None
        if not self.health.usable():
            return "the store is down"
        try:
            result = self._io.call("read", [keys[i] for i in wanted], [slots[i] for i in wanted], layout,
                                   traffic_class or DEFAULT_CLASS)
        except StoreUnavailable as exc:   # the I/O process is gone
            result = OpResult(error=str(exc), unavailable=str(exc), read_errors=1)
        self._apply(result, "read")
        return result.error
