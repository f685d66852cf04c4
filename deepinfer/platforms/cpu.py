"""Plain CPUs."""

from __future__ import annotations

import os

import torch

from deepinfer.platforms.base import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device = torch.device("cpu")
    # NOTE: bf16 is the CPU default. On the AVX512-BF16 machines we target, bf16 linear layers
    # run faster than fp32 for decode-shaped products (half the weight bytes to stream); where
    # the measurement is: docs/benchmarks/design-measurements.md#cpu-default-dtype. On a CPU
    # without native bf16 support, pass dtype="float32".
    default_dtype = torch.bfloat16

    def default_attention_backend(self):
        return "cpu", "the CPU fast path"

    def share_host_cores(self, num_ranks: int) -> None:
        # Ranks sharing a host's cores split them: with every rank on all of them, the ranks'
        # threads spin against each other at every collective, and each step takes many times
        # longer.
        if num_ranks > 1:
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // num_ranks))

    @property
    def packs_weights_for_host_kernels(self) -> bool:
        return True

    def kv_cache_budget_bytes(self, *, gpu_memory_utilization: float, cpu_kv_cache_bytes: int,
                              weight_bytes: int) -> int:
        return cpu_kv_cache_bytes

