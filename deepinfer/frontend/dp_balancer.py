"""Data parallelism behind one server (`deepinfer serve --data-parallel-size N`): which engine
core a new request goes to, and which devices each core gets.

N engine-core processes run behind the one front end (frontend/engine_client.py), each with its
own scheduler and KV pool; a core's data-parallel rank is its index, 0..N-1. A request lives on
one core from admission to its end, with its n > 1 children: they are admitted together and share
the prompt's KV blocks there (engine/admission.py).

Routing: the healthy core with the fewest unfinished sequences, ties to the lower index (vLLM's DP
load balancer picks the least loaded engine the same way, from the engines' waiting and running
counts). A sequence is what a core schedules (one child of a request: n = 4 counts 4). The counts
are the front end's own, exact without waiting for any core's stats: a sequence counts from when
it is sent until the front end forgets its request (finished, aborted, failed), so a burst that
arrives in one turn of the event loop spreads over the cores instead of piling onto the one whose
last stats looked idle. Cores that are not healthy (dead, restarting, stalled) are skipped, so
while one is restarted the others take the traffic.

Devices (`core_device_env`): on CUDA, core i sees the tensor_parallel_size devices from
i * tensor_parallel_size on, through CUDA_VISIBLE_DEVICES set in its process before CUDA starts
(so inside the core they are cuda:0 .. cuda:tp-1, as with one core). On the CPU every core runs
on the same CPU; nothing is pinned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from deepinfer.config import ParallelConfig
from deepinfer.platforms import visible_cuda_devices


@dataclass
class DPLoadBalancer:
    """Per-core counts of unfinished sequences, and the choice of a core for a new request."""

    num_engines: int
    unfinished: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {self.num_engines}")
        self.unfinished = [0] * self.num_engines

    def choose(self, available: Iterable[int]) -> int | None:
        """The least loaded of the `available` core indices (ties: the lowest); None if none is."""
        best = None
        for index in available:
            if best is None or (self.unfinished[index], index) < (self.unfinished[best], best):
                best = index
        return best

    def added(self, engine: int, num_sequences: int) -> None:
        self.unfinished[engine] += num_sequences

    def finished(self, engine: int, num_sequences: int) -> None:
        # Called exactly once per added() request (when the client forgets it), so a count below
        # zero is a bookkeeping bug that would skew every later choice: fail loudly.
        if self.unfinished[engine] < num_sequences:
            raise RuntimeError(f"engine core {engine} has {self.unfinished[engine]} unfinished sequences, "
                               f"{num_sequences} cannot finish")
        self.unfinished[engine] -= num_sequences


def core_device_env(parallel: ParallelConfig, rank: int) -> dict[str, str]:
    """Environment variables for data-parallel core `rank`'s process: CUDA_VISIBLE_DEVICES with its
    tensor_parallel_size devices on CUDA; nothing with one core (the user's own setting applies
    as it is) or on the CPU. Raises ValueError when fewer devices are visible than the cores need."""
    dp, tp = parallel.data_parallel_size, parallel.tensor_parallel_size
    if dp == 1:
        return {}
    visible = visible_cuda_devices()
    if visible is None:
        return {}   # the CPU, every core on it
    needed = dp * tp
    if len(visible) < needed:
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {needed} CUDA devices, but "
                         f"{len(visible)} are visible ({','.join(visible)})")
    return {"CUDA_VISIBLE_DEVICES": ",".join(visible[rank * tp:(rank + 1) * tp])}
