"""Host <-> device copies that never make the host wait for the device.

With overlapped scheduling the device is usually still busy with the previous step when the host
builds the next one, so a copy that waited for the device would undo the overlap. A plain
`tensor.to("cuda")` synchronises the stream (pageable host memory), and so does `torch.tensor(...,
device="cuda")`; going through pinned memory with non_blocking=True only queues the copy. On the
CPU both helpers return their input as is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(data: torch.Tensor | Sequence, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor (or a list) on `device`, the copy queued behind the device's current work."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """A host copy of t, started without waiting when t lives on a GPU (into pinned memory, the
    only kind a device-to-host copy can fill asynchronously). Read it after an event recorded
    behind the copy has fired."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)
