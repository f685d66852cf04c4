"""CUDA C++ kernels compiled at run time with NVRTC and launched through the CUDA driver API.

Most fast-path kernels are Triton. A kernel lands here when Triton cannot express what makes it
fast, such as the register layout of tensor-core fragments (layers/attention/cuda_decode.py).
NVRTC comes with every CUDA build of PyTorch: the nvidia-cuda-nvrtc wheel or the toolkit, and
torch loads it itself. So the user's machine needs no compiler and the project no new dependency;
this module only binds the dozen C functions it uses through ctypes.

A compiled kernel is machine code for the device's own architecture (a cubin). It is kept on
disk under DEEPINFER_CACHE_DIR/cuda_kernels, keyed by source, options, architecture and NVRTC
version, so a compile (slow: docs/benchmarks/design-measurements.md#nvrtc-disk-cache) happens once per
machine, not once per process.

Launches go on PyTorch's current stream, so they order with torch's kernels and are captured
into CUDA graphs like them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import threading

import torch

from deepinfer import envs

logger = logging.getLogger(__name__)


class NvrtcError(RuntimeError):
    """NVRTC or the driver is missing, or refused a kernel (the message says which and why)."""


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libnvrtc.so.{major}", "libnvrtc.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise NvrtcError(f"no NVRTC library (libnvrtc.so.{major}) is loadable in this process")


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise NvrtcError("the CUDA driver (libcuda.so.1) is not loadable") from e


def _check_nvrtc(code: int, what: str) -> None:
    if code != 0:
        lib = _nvrtc()
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(code).decode()}")


def _check_driver(code: int, what: str) -> None:
    if code != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(code, ctypes.byref(text))
        raise NvrtcError(f"{what}: CUDA error {code} ({(text.value or b'?').decode()})")


def _nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check_nvrtc(_nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return f"{major.value}.{minor.value}"


def compile_cubin(source: str, name: str, options: list[str], arch: str) -> bytes:
    """Machine code for `arch` (e.g. "sm_90") of `source`, from the disk cache when it is there."""
    key = hashlib.sha256("\0".join([source, *options, arch, _nvrtc_version()]).encode()).hexdigest()[:24]
    path = envs.cache_dir() / "cuda_kernels" / f"{name}-{key}.cubin"
    if path.exists():
        return path.read_bytes()
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
                 "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", *options]
        argv = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        code = lib.nvrtcCompileProgram(prog, len(opts), argv)
        if code != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"NVRTC could not compile {name} ({' '.join(options)}):\n{log.value.decode()}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    try:   # a cache that cannot be written only costs the next process a compile
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{threading.get_ident()}")
        tmp.write_bytes(cubin.raw)
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not cache the compiled kernel %s at %s: %s", name, path, e)
    return cubin.raw


class Kernel:
    """One `extern "C"` kernel of a loaded cubin, launched on the current torch stream.

    `arg_types` are the ctypes of its parameters in order (ctypes.c_void_p for pointers); a
    launch takes tensors for pointers and Python numbers for the rest."""

    def __init__(self, cubin: bytes, name: str, arg_types: list[type]) -> None:
        torch.cuda.init()   # the driver calls below run in torch's (primary) context
        driver = _driver()
        self._cubin = ctypes.create_string_buffer(cubin, len(cubin))   # kept alive with the module
        self._module = ctypes.c_void_p()
        _check_driver(driver.cuModuleLoadData(ctypes.byref(self._module), self._cubin), f"loading {name}")
        self._func = ctypes.c_void_p()
        _check_driver(driver.cuModuleGetFunction(ctypes.byref(self._func), self._module, name.encode()),
                      f"finding {name}")
        self.name = name
        self._arg_types = arg_types
        self._launch = driver.cuLaunchKernel

    def __call__(self, grid: int | tuple[int, int, int], block: int, *args) -> None:
        if len(args) != len(self._arg_types):
            raise TypeError(f"{self.name} takes {len(self._arg_types)} arguments, got {len(args)}")
        values = [kind(a.data_ptr() if isinstance(a, torch.Tensor) else a)
                  for kind, a in zip(self._arg_types, args)]
        argv = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values))
        gx, gy, gz = (grid, 1, 1) if isinstance(grid, int) else grid
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check_driver(self._launch(self._func, gx, gy, gz, block, 1, 1, 0, stream, argv, None),
                      f"launching {self.name}")


def load_kernel(source: str, name: str, options: list[str], arg_types: list[type],
                device: torch.device) -> Kernel:
    """Compile (or fetch from the disk cache) and load `name` for `device`'s architecture."""
    major, minor = torch.cuda.get_device_capability(device)
    with torch.cuda.device(device):
        return Kernel(compile_cubin(source, name, options, f"sm_{major}{minor}"), name, arg_types)
