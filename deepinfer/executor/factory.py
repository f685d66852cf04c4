"""Which executor runs: ParallelConfig.distributed_executor_backend, vLLM's field.

"uni" (one worker in this process), "mp" (tensor-parallel ranks in processes of this host) or
"ray" (ranks placed by a Ray cluster); unset, one rank runs "uni" and several "mp". The classes
are imported when chosen: Ray is an optional dependency.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.config import EngineConfig, ParallelConfig

if TYPE_CHECKING:
    from deepinfer.executor.abstract import Executor
    from deepinfer.models.loader import ModelSource


def executor_class(parallel: ParallelConfig) -> type[Executor]:
    """The executor class for ParallelConfig.executor_backend (uni for one rank unless another is
    named, mp for several)."""
    backend = parallel.executor_backend
    if backend == "uni":
        from deepinfer.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from deepinfer.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from deepinfer.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(f"distributed_executor_backend={backend!r} is not one of mp, ray, uni")


def make_executor(config: EngineConfig, source: ModelSource, *, load_weights: bool = True) -> Executor:
    """The executor `config` asks for, with its worker(s) ready to execute plans.
    `load_weights=False` keeps random weights (benchmarks of a real shape)."""
    return executor_class(config.parallel)(config, source, load_weights=load_weights)
