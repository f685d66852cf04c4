"""NVIDIA GPUs."""

from __future__ import annotations

import logging
import sys

import torch

from deepinfer import envs
from deepinfer.platforms.base import Platform

logger = logging.getLogger(__name__)

# The interpreter's GIL switch interval on a GPU engine (see settle_host_threads).
HOST_SWITCH_INTERVAL_S = 0.0002
# Cards with at least this much memory get the larger batch limits (batch_limits).
LARGE_CARD_BYTES = 70 << 30
# Left free when the KV pool is sized to the card's free memory (kv_cache_budget_bytes).
FREE_MARGIN_BYTES = 512 << 20


class CudaPlatform(Platform):
    name = "cuda"
    default_dtype = torch.bfloat16

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("DEEPINFER_ACCELERATOR=cuda but torch sees no CUDA device")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._held_before_us: int | None = None   # bytes the card held when this engine began

    def note_memory_baseline(self) -> None:
        if self._held_before_us is None:
            free, total = torch.cuda.mem_get_info(self.device)   # (creates this process's context)
            self._held_before_us = total - free - torch.cuda.memory_reserved(self.device)

    def default_attention_backend(self):
        try:
            import triton
        except ImportError as e:   # a torch build without Triton: the plain PyTorch path still runs
            return "reference", f"Triton does not import ({e}), so no fast path"
        return "triton", f"Triton {triton.__version__} imports"

    def kv_cache_budget_bytes(self, *, gpu_memory_utilization: float, cpu_kv_cache_bytes: int,
                              weight_bytes: int) -> int:
        # What this engine may use in all is a fraction of the card, as vLLM's flag means it: its
        # weights, the peak activation memory measured so far and what it holds outside torch's
        # allocator (CUDA libraries' workspaces) come off it, the rest is KV. What the card held
        # before this engine began (another replica sharing the card, at its own fraction) is not
        # this engine's; the KV never takes more than is free now, whatever the fraction says.
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        held_before = self._held_before_us if self._held_before_us is not None else total - free - reserved
        outside_torch = max(total - free - reserved - held_before, 0)
        budget = int(total * gpu_memory_utilization) - torch.cuda.max_memory_allocated(self.device) - outside_torch
        # Free now, plus what torch's allocator holds but no tensor uses, less a margin for the
        # allocations that follow (graphs, sampling buffers).
        room = free + reserved - torch.cuda.memory_allocated(self.device) - FREE_MARGIN_BYTES
        if room < budget:
            logger.warning("gpu_memory_utilization=%.2f would give the KV cache %.1f GiB, but the card has "
                           "%.1f GiB free (other processes hold %.1f GiB): the KV cache takes what is free",
                           gpu_memory_utilization, budget / 2**30, max(room, 0) / 2**30, held_before / 2**30)
        return max(min(budget, room), 0)

    def batch_limits(self, offline: bool) -> tuple[int, int]:
        # vLLM's rule: on a card of 70 GiB or more, 16384 batched tokens offline and 8192 for the
        # server; 8192 / 2048 below. Sequences: 512 on the large cards, where our decode CUDA
        # graphs stop (vLLM takes 1024, but at 1024 the rows past 512 run eagerly and (c) of
        # benchmarks/gpu_fast_path.py ran markedly slower, see
        # docs/benchmarks/design-measurements.md#cuda-max-num-seqs), 256 below.
        if torch.cuda.get_device_properties(self.device).total_memory >= LARGE_CARD_BYTES:
            return 512, 16384 if offline else 8192
        return 256, 8192 if offline else 2048

    @property
    def profiles_activation_peak(self) -> bool:
        return True

    @property
    def kv_budget_includes_weights(self) -> bool:
        # The budget is a fraction of the whole card (kv_cache_budget_bytes): all the process may use.
        return True

    def record_step_done(self) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record()
        return done

    @property
    def overlaps_host_and_device(self) -> bool:
        return True

    @property
    def grammar_masks_as_host_bias(self) -> bool:
        return False

    @property
    def ray_resource(self) -> str:
        return "GPU"

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def settle_host_threads(self) -> None:
        # With a GPU the host only prepares small inputs and launches kernels; torch's intra-op
        # thread pool (one thread per core) then only busy-waits against the threads that fill
        # grammar bitmasks, so the bitmask fill runs several times faster with one torch thread
        # than with one per core (docs/benchmarks/design-measurements.md#cuda-host-threads).
        # OMP_NUM_THREADS, when set, is the user's choice.
        if not envs.omp_threads_chosen() and torch.get_num_threads() > 1:
            logger.info("torch host threads %d -> 1 (set OMP_NUM_THREADS to choose)", torch.get_num_threads())
            torch.set_num_threads(1)
        # A worker thread that finished its GIL-free part (xgrammar's fill) needs the GIL back to
        # hand over its result, and the engine loop, running Python, gives it up only every
        # switch interval (Python's default interval is longer than a decode step). A shorter
        # interval about halved the step's wait for the fill
        # (docs/benchmarks/design-measurements.md#gil-switch-interval).
        if sys.getswitchinterval() > HOST_SWITCH_INTERVAL_S:
            sys.setswitchinterval(HOST_SWITCH_INTERVAL_S)
