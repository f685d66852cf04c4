"""Executors: run the engine core's plans on the model's worker(s) (DESIGN.md, "The seams").

    abstract.py   the interface the engine core talks to, and the choice by
                  ParallelConfig.distributed_executor_backend (`Executor.get_class`)
    uniproc.py    one worker in the engine core's own process ("uni", the default for one rank)
    multiproc.py  tensor-parallel ranks on this host: rank 0 in the engine core's process, the
                  others in processes of their own (worker/rank_worker.py); "mp"
    ray_executor.py  the same ranks placed by a Ray cluster, any number of nodes; "ray"
"""

from deepinfer.executor.abstract import Executor

__all__ = ["Executor"]
