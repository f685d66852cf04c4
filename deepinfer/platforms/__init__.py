"""Platforms: the accelerator the engine runs on, chosen once by DEEPINFER_ACCELERATOR.

`current_platform()` resolves `auto` to CUDA when a CUDA device is present, else the CPU. The
platform owns the device, the default dtype, the memory query and what attention_backend="auto"
means on it (Platform.default_attention_backend); nothing else in the engine branches on
`torch.cuda.is_available()`.
"""

from __future__ import annotations

import functools

from deepinfer import envs
from deepinfer.platforms.base import Platform


@functools.cache
def current_platform() -> Platform:
    choice = envs.accelerator()
    if choice == "auto":
        import torch

        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        from deepinfer.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from deepinfer.platforms.cpu import CpuPlatform

    return CpuPlatform()


__all__ = ["Platform", "current_platform"]
