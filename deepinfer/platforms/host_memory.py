"""Host memory the device can copy into and out of asynchronously: the host KV tier's storage.

On CUDA the buffer is page-locked host memory mapped into the device's address space
(cuMemHostAlloc with DEVICEMAP: exactly the size asked, where torch's pinned allocator rounds
each allocation up to a power of two, which for a tier of many GiB would pin far more than
asked), and a device tensor aliases it. Kernels that index that view (index_select /
index_copy_) then move a whole batch of scattered blocks between host and device in one launch,
on whatever stream they run, and the host never touches the bytes. On the CPU the buffer is
plain memory, and both views are the same tensor.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

# cuMemHostAlloc flags: usable from every context (PORTABLE), mapped into the device (DEVICEMAP).
_CU_MEMHOSTALLOC_PORTABLE = 0x01
_CU_MEMHOSTALLOC_DEVICEMAP = 0x02


class _CudaArray:
    """The smallest object torch.as_tensor reads as device memory (CUDA array interface v3)."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 3}


class HostBuffer:
    """`nbytes` of host memory: `host` (a CPU uint8 tensor) and `device_view` (the same bytes as a
    uint8 tensor on `device`; `host` itself on the CPU). Freed once both views are dropped."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        if device.type == "cpu":
            self.host = self.device_view = torch.empty(nbytes, dtype=torch.uint8)
            return
        if device.type != "cuda":
            raise NotImplementedError(f"no host KV tier for device type {device.type!r}")
        from deepinfer.platforms.nvrtc import _check_driver, _driver

        driver = _driver()
        with torch.cuda.device(device):
            torch.zeros(1, device=device)   # torch's context is current on this thread from here on
            pointer = ctypes.c_void_p()
            _check_driver(driver.cuMemHostAlloc(ctypes.byref(pointer), ctypes.c_size_t(nbytes),
                                                _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP),
                          f"cuMemHostAlloc of {nbytes} bytes for the host KV tier")
            device_pointer = ctypes.c_uint64()
            _check_driver(driver.cuMemHostGetDevicePointer_v2(ctypes.byref(device_pointer), pointer, 0),
                          "cuMemHostGetDevicePointer")
            # Each view's storage holds its source object until the last tensor over it is gone
            # (frombuffer and the array interface both do): the memory is freed after both.
            owner = _Allocation(pointer.value, device)
            host_source = (ctypes.c_uint8 * nbytes).from_address(pointer.value)
            device_source = _CudaArray(device_pointer.value, nbytes)
            for source in (host_source, device_source):
                weakref.finalize(source, owner.drop)
            self.host = torch.frombuffer(host_source, dtype=torch.uint8)
            self.device_view = torch.as_tensor(device_source, device=device)
        if self.device_view.data_ptr() != device_pointer.value:
            # as_tensor copies when it places the memory on another device: that would be a copy
            # of the tier, not the tier.
            raise RuntimeError(f"the device view of the host KV tier is not an alias on {device}")


class _Allocation:
    """Frees cuMemHostAlloc memory once both views' sources are collected, after the device is
    done with it (a side-stream copy may still be reading it)."""

    def __init__(self, pointer: int, device: torch.device) -> None:
        self.pointer, self.device, self.views = pointer, device, 2

    def drop(self) -> None:
        self.views -= 1
        if self.views:
            return
        try:
            from deepinfer.platforms.nvrtc import _driver

            torch.cuda.synchronize(self.device)
            _driver().cuMemFreeHost(ctypes.c_void_p(self.pointer))
        except Exception:   # interpreter shutdown: the driver may be gone, and the pages with it
            pass
