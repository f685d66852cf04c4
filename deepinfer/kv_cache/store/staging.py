"""The persistent store's staging buffer: host memory, allocated once, that every block on its way
between the device and the store passes through.

A save copies its blocks device -> staging slots on the step (one gather per layer on a side
stream); the writer threads encode and write from those slots and free them. A load's reader
threads decode entries straight into slots; the step then copies slots -> device blocks. On CUDA
the buffer is page-locked host memory mapped into the device (platforms/host_memory.py), so both
copies are index kernels over a device view of it: nothing is allocated or page-locked per
transfer, and the host never waits for the device. (Allocating pinned memory per save, as this
tier first did, cost the step ~15 % of an H200's throughput at a 0 % hit rate, and loads pinned
their whole payload on the step.)

A slot holds one block of one group's payload, [layers, K/V, page bytes]. Slots are taken and
freed under a lock by the step thread and the I/O threads; a transfer that finds too few free
slots takes what there is (saves: their leading blocks, the ones a later prefix hit needs first)
or fails (loads: the request recomputes), and the buffer's size bounds what is in flight.
"""

from __future__ import annotations

import threading

import torch

from deepinfer.platforms.host_memory import HostBuffer, SharedHostBuffer


def staging_shape(payload_bytes: list[int], buffer_bytes: int) -> tuple[int, int]:
    """(slot bytes, slots) of a buffer for groups of these payload sizes (one slot size for all,
    rounded so that every word type tiles a slot's rows). Both sides of the connector compute it:
    the scheduler side bounds a request's loads by it."""
    slot_bytes = -(-max(payload_bytes) // 64) * 64
    return slot_bytes, max(buffer_bytes // slot_bytes, 1)


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
        self._lock = threading.Lock()
        self._free = list(range(num_slots - 1, -1, -1))   # popped from the end: low slots first

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self, n: int, partial: bool = False) -> list[int]:
        """n slots, or fewer when `partial` and fewer are free ([] when none, or when not
        `partial` and fewer than n are free)."""
        with self._lock:
            if len(self._free) < n and not partial:
                return []
            k = min(n, len(self._free))
            taken = self._free[len(self._free) - k:]
            del self._free[len(self._free) - k:]
        taken.reverse()
        return taken

    def free(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def rows(self, view: torch.Tensor, payload_bytes: int, word: torch.dtype, num_layers: int) -> torch.Tensor:
        """`view` (host or device_view) as [slots, layers, 2, words] of a group's payload (an alias)."""
        return view[:, :payload_bytes].view(word).view(self.num_slots, num_layers, 2, -1)

    def close(self) -> None:
        self.host = self.device_view = None
        if isinstance(self._buffer, SharedHostBuffer):
            self._buffer.close()
