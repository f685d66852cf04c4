"""Executors: run the engine core's plans on the model's worker(s) (DESIGN.md, "The seams").

    abstract.py   the interface the engine core talks to
    factory.py    the choice by ParallelConfig.distributed_executor_backend (`make_executor`)
    uniproc.py    one worker in the engine core's own process ("uni", the default for one rank)
    ranked.py     several tensor-parallel ranks: rank 0 in the engine core's process, the others
                  behind handles that replay its calls (worker/rank_worker.py); failures
    multiproc.py  those ranks as processes of this host ("mp")
    ray_executor.py  those ranks as actors a Ray cluster places, any number of nodes ("ray")
"""

from deepinfer.executor.abstract import Executor
from deepinfer.executor.factory import executor_class, make_executor

__all__ = ["Executor", "executor_class", "make_executor"]
