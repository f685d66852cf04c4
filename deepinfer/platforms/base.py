"""What every platform must answer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Platform(ABC):
    name: str
    device: torch.device
    # The dtype used when the user asks for dtype="auto".
    default_dtype: torch.dtype

    @abstractmethod
    def default_attention_backend(self) -> tuple[str, str]:
        """The name of the attention backend attention_backend="auto" means here, and why (for the
        start-up log line). A name, not the class: the backends import the platform, so the
        platform names its choice and layers/attention/backends/selection.py builds and checks it."""

    @abstractmethod
    def kv_cache_budget_bytes(self, *, gpu_memory_utilization: float, cpu_kv_cache_bytes: int,
                              weight_bytes: int) -> int:
        """Bytes the KV pool may take on this platform after the weights are loaded."""

    def note_memory_baseline(self) -> None:
        """Called by the runner before it builds the model: what the device holds then is not this
        engine's (another replica on the same card), so the KV budget does not count it."""

    def batch_limits(self, offline: bool) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) used when the user sets neither: the offline
        `LLM` class favours throughput, the server a shorter step (time between tokens)."""
        return 256, 2048

    # What the engine asks of the platform instead of comparing its name (one group; each is
    # answered by cpu.py and cuda.py).
    def share_host_cores(self, num_ranks: int) -> None:
        """Called by each of `num_ranks` tensor-parallel ranks on one host before its model is built."""

    @property
    def packs_weights_for_host_kernels(self) -> bool:
        """Whether the forward runs on host kernels that want packed weight copies (4-bit, oneDNN)."""
        return False

    @property
    def profiles_activation_peak(self) -> bool:
        """Whether the KV budget is what the memory query sees left after a profiled forward's peak."""
        return False

    @property
    def kv_budget_includes_weights(self) -> bool:
        """Whether weights loaded after the KV pool is sized (a draft model's) come off its budget."""
        return False

    def record_step_done(self) -> torch.cuda.Event | None:
        """An event recorded after the work queued so far; None where that work is done already."""
        return None

    @property
    def overlaps_host_and_device(self) -> bool:
        """Whether the forward runs on a device the host can run ahead of: the default for
        overlapped scheduling (engine/core.py, resolve_async_scheduling)."""
        return False

    @property
    def grammar_masks_as_host_bias(self) -> bool:
        """Whether structured-output masks are unpacked into an additive bias on the host (the
        forward runs there) rather than shipped packed to the device's masking kernel."""
        return True

    @property
    def ray_resource(self) -> str:
        """The Ray resource each rank takes one of (executor/ray_executor.py's placement bundles)."""
        return "CPU"

    def synchronize(self) -> None:
        pass

    def settle_host_threads(self) -> None:
        """Called once the model is loaded, before serving: set the host's torch threads and the
        interpreter's thread switching for the engine loop. The CPU keeps the defaults (its
        forward runs on torch's threads)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, default_dtype={self.default_dtype})"
