"""The `ray` executor: tensor-parallel ranks placed by a Ray cluster, on any of its nodes.

Rank 0 runs in the engine core's process (ranked.py says how the ranks work together and fail);
ranks 1..N-1 are Ray actors, one CPU (or one GPU on CUDA) each, reserved together in a placement
group so that a start never holds half the ranks it needs. Calls reach an actor as actor tasks,
which Ray runs in the order one caller submitted them; nothing waits for their results, which
are looked at only to see a rank fail.

Which cluster: the one this process is connected to already, else the one `RAY_ADDRESS` names
(Ray reads it itself, e.g. `ray start --head` then RAY_ADDRESS=host:port), else a local one Ray
starts for this engine. The ranks meet rank 0 at this node's address, so it must be reachable
from the other nodes. Every node needs deepinfer and the model at the same path.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from deepinfer.executor.ranked import RankedExecutor, RankFailedError, RankHandle
from deepinfer.platforms import current_platform
from deepinfer.worker.rank_worker import RankSpec, RankWorker

logger = logging.getLogger(__name__)

RANK_EXIT_WAIT_S = 10.0
PLACEMENT_TIMEOUT_S = 120.0


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("distributed_executor_backend='ray' needs Ray: pip install ray") from exc
    return ray


class _RankActorBody:
    """What runs inside a rank's actor: a RankWorker and rank 0's calls, in order."""

    def __init__(self, spec: RankSpec) -> None:
        self.worker = RankWorker(spec)   # meets rank 0 at the rendezvous, builds its runner

    def ready(self) -> bool:
        return True

    def call(self, method: str, step: int, payload: Any) -> None:
        self.worker.handle(method, step, payload)

    def close(self) -> None:
        self.worker.close()


class _RankActor(RankHandle):
    def __init__(self, spec: RankSpec, actor_class, placement_group, bundle: int, use_gpu: bool) -> None:
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.rank = spec.rank
        self.actor = actor_class.options(
            num_cpus=0 if use_gpu else 1, num_gpus=1 if use_gpu else 0, name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, bundle)).remote(spec)
        self._ready_ref = self.actor.ready.remote()
        self._pending: list = []   # refs of calls not seen finished yet
        self._ray = ray

    def send(self, message: tuple[str, int, Any]) -> None:
        self._pending.append(self.actor.call.remote(*message))
        if len(self._pending) > 64:   # look at finished calls now and then, so the list stays short
            failure = self.failure()
            if failure is not None:
                raise RankFailedError(f"tensor-parallel rank {self.rank}: {failure}")

    def failure(self) -> str | None:
        ray = self._ray
        refs = [self._ready_ref, *self._pending] if not self.ready else self._pending
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:   # noqa: BLE001  (the actor's error, or its death)
                return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
            if ref is self._ready_ref:
                self.ready = True
        self._pending = [r for r in self._pending if r not in done]
        return None

    def stop(self) -> None:
        ray = self._ray
        try:
            ray.get(self.actor.close.remote(), timeout=RANK_EXIT_WAIT_S)
        except Exception:   # noqa: BLE001  (already dead, or stuck: killed below either way)
            pass
        ray.kill(self.actor)


class RayExecutor(RankedExecutor):
    """Ranks 1..N-1 as Ray actors in one placement group."""

    name = "ray"
    _placement_group = None
    _started_ray = False

    def rendezvous_host(self) -> str:
        self._connect()
        return _ray().util.get_node_ip_address()

    def _connect(self) -> None:
        ray = _ray()
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING, log_to_driver=False)
            self._started_ray = True

    def start_ranks(self, specs: list[RankSpec]) -> list[RankHandle]:
        ray = _ray()
        from ray.util.placement_group import placement_group

        if not specs:
            return []
        resource = current_platform().ray_resource
        use_gpu = resource == "GPU"
        # Ray shows an actor only the GPU it was given, as device 0.
        specs = [dataclasses.replace(spec, local_device_index=0) for spec in specs]
        bundle = {resource: 1}
        self._placement_group = placement_group([bundle] * len(specs), strategy="PACK")
        ready, _ = ray.wait([self._placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RankFailedError(f"the Ray cluster could not place {len(specs)} ranks of {bundle} within "
                                  f"{PLACEMENT_TIMEOUT_S:.0f} s (ray status shows its free resources)")
        actor_class = ray.remote(_RankActorBody)
        ranks: list[RankHandle] = []
        for i, spec in enumerate(specs):
            ranks.append(_RankActor(spec, actor_class, self._placement_group, i, use_gpu))
            self.ranks = ranks
        return ranks

    def shutdown(self) -> None:
        super().shutdown()
        ray = _ray()
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
            self._placement_group = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
