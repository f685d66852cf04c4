"""What the engine asks the platform instead of comparing its name (platforms/base.py), answered
by the CPU and the CUDA platform; the CUDA answers are asked without a GPU (the device is not
touched)."""

from __future__ import annotations

import os

import torch

from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.cuda import CudaPlatform


def test_each_platform_answers_what_the_runner_asks():
    cpu, cuda = CpuPlatform(), object.__new__(CudaPlatform)
    # Packed 4-bit / oneDNN weight copies serve host kernels only.
    assert cpu.packs_weights_for_host_kernels and not cuda.packs_weights_for_host_kernels
    # The KV budget on a GPU is what the memory query sees left, weights and activations included.
    assert cuda.profiles_activation_peak and not cpu.profiles_activation_peak
    assert cuda.kv_budget_includes_weights and not cpu.kv_budget_includes_weights
    # The CPU's work is done when queued: no event to wait on.
    assert cpu.record_step_done() is None
    assert (cpu.ray_resource, cuda.ray_resource) == ("CPU", "GPU")
    # Overlapped scheduling by default only where a device runs ahead of the host.
    assert cuda.overlaps_host_and_device and not cpu.overlaps_host_and_device
    # Grammar masks become an additive bias where the forward runs on the host.
    assert cpu.grammar_masks_as_host_bias and not cuda.grammar_masks_as_host_bias


def test_ranks_on_one_host_share_its_cores():
    before = torch.get_num_threads()
    try:
        CpuPlatform().share_host_cores(1)   # one rank: torch's threads as they are
        assert torch.get_num_threads() == before
        CpuPlatform().share_host_cores(2)
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
        object.__new__(CudaPlatform).share_host_cores(2)   # the forward runs on the GPU: no change
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
    finally:
        torch.set_num_threads(before)

