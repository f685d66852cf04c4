"""Distributed execution: the process groups a model's layers talk over, and their collectives.

    parallel_state.py   ParallelGroup: one engine's ranks and their collectives (all-reduce,
                        all-gather, all-to-all; NCCL on CUDA, gloo on CPU, no-ops on one rank),
                        started and ended by the executors

Layers take their group once, at construction (`current_tp_group()`), so a model built outside
any distributed run (a draft model, a test) gets the size-1 group and costs nothing extra.
"""

from deepinfer.distributed.parallel_state import (
    ParallelGroup,
    building_with,
    current_tp_group,
    init_distributed,
    shutdown_distributed,
)

__all__ = ["ParallelGroup", "building_with", "current_tp_group", "init_distributed", "shutdown_distributed"]
