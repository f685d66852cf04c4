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
            # Each view's storage holds its source object until the last tensor over it is gone
            # (frombuffer and the array interface both do): the memory is freed after both.
            owner = _Allocation(pointer.value, device)
            host_source = (ctypes.c_uint8 * nbytes).from_address(pointer.value)
            device_source, self.device_view = _device_alias(driver, pointer.value, nbytes, device)
            for source in (host_source, device_source):
                weakref.finalize(source, owner.drop)
            self.host = torch.frombuffer(host_source, dtype=torch.uint8)


def _device_alias(driver, host_pointer: int, nbytes: int, device: torch.device) -> tuple[_CudaArray, torch.Tensor]:
    """Page-locked host memory mapped into the device, as a uint8 tensor on `device` that aliases
    it (and the array-interface object that tensor's storage holds)."""
    from deepinfer.platforms.nvrtc import _check_driver

    device_pointer = ctypes.c_uint64()
    _check_driver(driver.cuMemHostGetDevicePointer_v2(ctypes.byref(device_pointer), ctypes.c_void_p(host_pointer), 0),
                  "cuMemHostGetDevicePointer")
    source = _CudaArray(device_pointer.value, nbytes)
    view = torch.as_tensor(source, device=device)
    if view.data_ptr() != device_pointer.value:
        # as_tensor copies when it places the memory on another device: that would be a copy of
        # the host memory, not a view of it.
        raise RuntimeError(f"the device view of {nbytes} bytes of host memory is not an alias on {device}")
    return source, view


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


_CU_MEMHOSTREGISTER_PORTABLE = 0x01
_CU_MEMHOSTREGISTER_DEVICEMAP = 0x02


class SharedHostBuffer:
    """`nbytes` of host memory another process can map too (a Linux memfd: `fd`, inherited by a
    child that maps it with `map_shared`), with the same two views as HostBuffer: `host`, and on
    CUDA `device_view`, the pages registered page-locked and mapped into the device
    (cuMemHostRegister), so index kernels move blocks in and out while the other process reads
    and writes the same bytes. Freed (unregistered, unmapped, closed) with `close()` or at exit."""

    def __init__(self, nbytes: int, device: torch.device, name: str = "deepinfer-shared") -> None:
        import mmap
        import os

        self.nbytes = nbytes
        self.fd = os.memfd_create(name, 0)   # no MFD_CLOEXEC: the child inherits it through pass_fds
        os.ftruncate(self.fd, nbytes)
        self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._pointer = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.host = torch.frombuffer(self._map, dtype=torch.uint8)
        self.device = device
        self._registered = False
        if device.type == "cpu":
            self.device_view = self.host
            return
        if device.type != "cuda":
            raise NotImplementedError(f"no shared host buffer for device type {device.type!r}")
        from deepinfer.platforms.nvrtc import _check_driver, _driver

        driver = _driver()
        with torch.cuda.device(device):
            torch.zeros(1, device=device)   # torch's context is current on this thread from here on
            _check_driver(driver.cuMemHostRegister_v2(ctypes.c_void_p(self._pointer), ctypes.c_size_t(nbytes),
                                                      _CU_MEMHOSTREGISTER_PORTABLE | _CU_MEMHOSTREGISTER_DEVICEMAP),
                          f"cuMemHostRegister of {nbytes} bytes")
            self._registered = True
            self._source, self.device_view = _device_alias(driver, self._pointer, nbytes, device)

    def close(self) -> None:
        """Unregister and unmap (every view of the buffer must be dropped by then)."""
        import os

        if self._map is None:
            return
        self.host = self.device_view = None
        if self._registered:
            try:
                from deepinfer.platforms.nvrtc import _driver

                torch.cuda.synchronize(self.device)
                _driver().cuMemHostUnregister(ctypes.c_void_p(self._pointer))
            except Exception:   # interpreter shutdown: the driver may be gone
                pass
        try:
            self._map.close()
        except BufferError:   # a view is still alive: the mapping goes with the process
            pass
        self._map = None
        os.close(self.fd)


def map_shared(fd: int, nbytes: int) -> torch.Tensor:
    """The other process's side of a SharedHostBuffer: its bytes as a CPU uint8 tensor."""
    import mmap

    return torch.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
                            dtype=torch.uint8)
