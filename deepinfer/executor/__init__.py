"""Executors: run the engine core's plans on the model's worker(s) (DESIGN.md, "The seams").

    abstract.py   the interface the engine core talks to, and the choice by
                  ParallelConfig.distributed_executor_backend (`Executor.get_class`)
    uniproc.py    one worker in the engine core's own process ("uni", the default)

`mp` (one process per rank) and `ray` come later behind the same interface.
"""

from deepinfer.executor.abstract import Executor

__all__ = ["Executor"]
