"""Plain CPUs."""

from __future__ import annotations

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
        from deepinfer.layers.attention.backends.cpu import CpuBackend

        return CpuBackend, "the CPU fast path"

    def kv_cache_budget_bytes(self, *, gpu_memory_utilization: float, cpu_kv_cache_bytes: int,
                              weight_bytes: int) -> int:
        return cpu_kv_cache_bytes
