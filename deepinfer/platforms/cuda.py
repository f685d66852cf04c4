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


class CudaPlatform(Platform):
    name = "cuda"
    default_dtype = torch.bfloat16

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("DEEPINFER_ACCELERATOR=cuda but torch sees no CUDA device")
        self.device = torch.device("cuda", torch.cuda.current_device())

    def default_attention_backend(self):
        try:
            import triton
        except ImportError as e:   # a torch build without Triton: the plain PyTorch path still runs
            return "reference", f"Triton does not import ({e}), so no fast path"
        return "triton", f"Triton {triton.__version__} imports"

    def kv_cache_budget_bytes(self, *, gpu_memory_utilization: float, cpu_kv_cache_bytes: int,
                              weight_bytes: int) -> int:
        # What the process may use in all is a fraction of the card; the weights and the peak
        # activation memory measured so far come off it, the rest is KV.
        free, total = torch.cuda.mem_get_info(self.device)
        torch.cuda.synchronize(self.device)
        in_use_by_us = torch.cuda.max_memory_allocated(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * gpu_memory_utilization) - used_by_others - in_use_by_us
        return max(budget, 0)

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
