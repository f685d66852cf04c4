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


def use_local_device(index: int) -> None:
    """Make CUDA device `index` this process's device (a rank of several on one host), before
    current_platform() reads it; nothing where the engine runs on the CPU."""
    import torch

    if torch.cuda.is_available() and envs.accelerator() != "cpu":
        torch.cuda.set_device(index)


def visible_cuda_devices() -> list[str] | None:
    """The CUDA devices this process may hand to the processes it starts: CUDA_VISIBLE_DEVICES,
    else every device torch sees. None where the engine runs on the CPU (DEEPINFER_ACCELERATOR=cpu,
    or auto without a visible device); ValueError for DEEPINFER_ACCELERATOR=cuda without one."""
    accelerator = envs.accelerator()
    if accelerator == "cpu":
        return None
    visible = envs.cuda_visible_devices()
    if visible is None:
        import torch

        visible = [str(i) for i in range(torch.cuda.device_count())]
    if not visible:
        if accelerator == "cuda":
            raise ValueError("DEEPINFER_ACCELERATOR=cuda but no CUDA device is visible")
        return None   # auto without CUDA: the CPU
    return visible


__all__ = ["Platform", "current_platform", "use_local_device", "visible_cuda_devices"]
