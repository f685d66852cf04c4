"""The persistent store's staging buffer: host memory, allocated once, that every block on its way
between the device and the store passes through.

A save copies its blocks device -> staging slots on the step (a gather in device memory, then
an asynchronous copy per run of consecutive slots, on a side stream); the writer threads encode
and write from those slots and free them. A load's reader threads decode entries straight into
slots; the step then copies slots -> device blocks the same way round. On CUDA the buffer is
page-locked host memory (platforms/host_memory.py; shared with the I/O process when it has one),
so those copies run on the copy engine: nothing is allocated or page-locked per transfer, and the
host never waits for the device. (A worker that allocated page-locked memory per save and dropped
a save whole past a bound kept only the start of a long prefix:
docs/benchmarks/design-measurements.md#kv-store-staging-buffer.)

A slot holds one block of one group's payload, [layers, K/V, page bytes]; an entry (a run of
blocks, runs.py) is read into and written from one slot per block, its slots taken together, so
each half holds at least one run of the longest kind (staging_shape's min_slots: two runs; a
smaller kv_store_buffer_size is raised to that, with a warning). Slots are taken and freed under
a lock by the step thread and the I/O threads. Saves and loads each have half of
them: a store that writes slower than the engine computes fills the saves' half, and a load must
still find room (a server whose saves had filled one shared buffer failed the next long load).
Neither direction is bounded by the buffer's size: a transfer larger than its half, or finding
too little room, streams through it. A save stages what fits and the rest when slots come free
(its device blocks stay held until then: the save is not finished); a load is read run by run,
each run copied in as it lands and its slots freed, while the reader takes slots for the next
ones (take(..., wait_s)).
Free slots are kept in order, so a transfer's slots are mostly consecutive and on CUDA move in a
few large copies.
"""

from __future__ import annotations

import logging
import threading

import torch

from deepinfer.platforms.host_memory import HostBuffer, SharedHostBuffer

logger = logging.getLogger(__name__)


def staging_shape(payload_bytes: list[int], buffer_bytes: int, min_slots: int = 1) -> tuple[int, int]:
    """(slot bytes, slots) of a buffer for groups of these payload sizes (one slot size for all,
    rounded so that every word type tiles a slot's rows), at least `min_slots` slots (an entry's
    run must fit each half whole)."""
    slot_bytes = -(-max(payload_bytes) // 64) * 64
    slots = buffer_bytes // slot_bytes
    if slots < min_slots > 1:
        logger.warning("kv_store_buffer_size holds %d blocks; raised to %d (two runs of %d blocks: an entry is "
                       "staged whole)", slots, min_slots, min_slots // 2)
    return slot_bytes, max(slots, min_slots, 1)


class StagingBuffer:
    def __init__(self, slot_bytes: int, num_slots: int, device: torch.device, shared: bool = False) -> None:
        """`shared`: memory another process maps too (`fd`: the I/O process's, entry_io.py)."""
        if num_slots < 1:
            raise ValueError(f"the KV store's staging buffer holds no block of {slot_bytes} bytes")
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        if shared:
            self._buffer = SharedHostBuffer(slot_bytes * num_slots, device, "deepinfer-kv-staging")
            self.fd = self._buffer.fd
        else:
            self._buffer = HostBuffer(slot_bytes * num_slots, device)
            self.fd = None
        self.host = self._buffer.host.view(num_slots, slot_bytes)             # what the I/O threads read and write
        self.device_view = self._buffer.device_view.view(num_slots, slot_bytes)   # what the copies index
        # Whether torch copies to and from the host side asynchronously (it must know the pages
        # as locked; else a non-blocking copy would wait for the device on the step's thread).
        self.dma = device.type == "cuda" and self.host.is_pinned()
        if device.type == "cuda" and not self.dma:
            logger.warning("the KV store's staging buffer is not seen as page-locked; its copies run as kernels")
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)   # notified when slots are freed
        self._free = list(range(num_slots - 1, -1, -1))   # popped from the end: low slots first
        self.quota = {"save": max(num_slots // 2, 1), "load": max(num_slots - num_slots // 2, 1)}
        self._used = {"save": 0, "load": 0}

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def room(self, kind: str) -> int:
        """Slots `kind` could take now."""
        with self._lock:
            return min(len(self._free), self.quota[kind] - self._used[kind])

    def take(self, n: int, kind: str, partial: bool = False, wait_s: float = 0.0) -> list[int]:
        """n slots of `kind`'s half (save | load), ascending, or fewer when `partial` and fewer
        are free ([] when none, or when not `partial` and fewer than n are free). `wait_s`: wait
        up to that long for n to come free (n must fit the half)."""
        if n > self.quota[kind] and not partial:
            raise ValueError(f"{n} blocks do not fit the {kind}s' half of the staging buffer ({self.quota[kind]})")
        with self._lock:
            room = min(len(self._free), self.quota[kind] - self._used[kind])
            if room < n and wait_s > 0:
                self._room.wait_for(lambda: min(len(self._free), self.quota[kind] - self._used[kind]) >= n, wait_s)
                room = min(len(self._free), self.quota[kind] - self._used[kind])
            if room < n and not partial:
                return []
            k = max(min(n, room), 0)
            taken = self._free[len(self._free) - k:]
            del self._free[len(self._free) - k:]
            self._used[kind] += k
        taken.reverse()
        return taken

    def free(self, slots: list[int], kind: str) -> None:
        with self._lock:
            self._free.extend(slots)
            self._free.sort(reverse=True)
            self._used[kind] -= len(slots)
            self._room.notify_all()

    def rows(self, view: torch.Tensor, payload_bytes: int, word: torch.dtype, num_layers: int,
             tensors: int = 2) -> torch.Tensor:
        """`view` (host or device_view) as [slots, layers, tensors (K, V), words] of a group's
        payload (an alias)."""
        return view[:, :payload_bytes].view(word).view(self.num_slots, num_layers, tensors, -1)

    @staticmethod
    def runs(slots: list[int]):
        """(index, first slot, length) of each run of consecutive slots in `slots`."""
        i = 0
        while i < len(slots):
            j = i + 1
            while j < len(slots) and slots[j] == slots[j - 1] + 1:
                j += 1
            yield i, slots[i], j - i
            i = j

    def close(self) -> None:
        self.host = self.device_view = None
        if isinstance(self._buffer, SharedHostBuffer):
            self._buffer.close()
