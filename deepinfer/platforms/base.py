"""What every platform must answer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepinfer.layers.attention.backends import AttentionBackend


class Platform(ABC):
    name: str
    device: torch.device
    # The dtype used when the user asks for dtype="auto".
    default_dtype: torch.dtype

    @abstractmethod
    def default_attention_backend(self) -> tuple[type[AttentionBackend], str]:
        """The attention backend attention_backend="auto" means here, and why (for the start-up
        log line; layers/attention/backends/selection.py builds and checks it)."""

    @abstractmethod
    def kv_cache_budget_bytes(self, *, gpu_memory_utilization: float, cpu_kv_cache_bytes: int,
                              weight_bytes: int) -> int:
        """Bytes the KV pool may take on this platform after the weights are loaded."""

    def batch_limits(self, offline: bool) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) used when the user sets neither: the offline
        `LLM` class favours throughput, the server a shorter step (time between tokens)."""
        return 256, 2048

    def synchronize(self) -> None:
        pass

    def settle_host_threads(self) -> None:
        """Called once the model is loaded, before serving: set the host's torch threads and the
        interpreter's thread switching for the engine loop. The CPU keeps the defaults (its
        forward runs on torch's threads)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, default_dtype={self.default_dtype})"
