"""What the multi-rank executors share: rank 0 here, the other ranks behind handles.

Rank 0's ModelRunner runs in the engine core's own process, as the in-process executor's does, so
one rank costs nothing more than `uni`. Each executor call is sent to every other rank first,
then made on rank 0: all ranks run the same plan at once and meet in the layers' collectives
(gloo on CPU, NCCL on CUDA). The scheduler reads rank 0's results only. How the other ranks are
started and reached is the subclass's: child processes of this host (multiproc.py) or actors a
Ray cluster places (ray_executor.py).

Failures: a rank that fails to start reports its error, and rank 0 raises it (naming the rank)
instead of waiting at the rendezvous. A rank that dies later closes its sockets, so rank 0's next
collective fails at once; the executor then raises `RankFailedError` with that rank's exit code
or last words, the engine core's step fails, and the server's supervision takes over (health
503, restart). Nothing waits forever: a rank that hangs is bounded by the group's timeout.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from deepinfer.config import EngineConfig
from deepinfer.distributed import init_distributed, shutdown_distributed
from deepinfer.executor.uniproc import UniProcExecutor
from deepinfer.platforms import current_platform
from deepinfer.types.plan import ForwardStep, GrammarOutput, LaunchedStep, RunnerResult, SchedulerPlan
from deepinfer.worker.model_runner import ModelRunner
from deepinfer.worker.rank_worker import RankSpec

if TYPE_CHECKING:
    from deepinfer.models.loader import ModelSource
    from deepinfer.types.drafter import Draft, DraftRequest

logger = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """A tensor-parallel rank other than 0 failed or died; the engine cannot go on."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankHandle(ABC):
    """Rank 0's view of one other rank."""

    rank: int
    ready: bool = False

    @abstractmethod
    def send(self, message: tuple[str, int, Any]) -> None:
        """Queue one call (method, step id, payload) on the rank, in order; never waits for it."""

    @abstractmethod
    def failure(self) -> str | None:
        """What went wrong with the rank, if anything; also notes when it has become ready."""

    @abstractmethod
    def stop(self) -> None:
        """Ask the rank to end, wait a bounded time, then end it."""


class RankedExecutor(UniProcExecutor):
    """Rank 0 in this process (UniProcExecutor's runner), the other ranks behind RankHandles."""

    name = "ranked"

    def __init__(self, config: EngineConfig, source: ModelSource, *, load_weights: bool = True) -> None:
        size = config.parallel.world_size
        host = self.rendezvous_host()
        port = free_port(host)
        self.ranks: list[RankHandle] = []
        self.group = None
        self.runner = None
        self._step_ids = itertools.count()
        try:
            self.ranks = self.start_ranks([RankSpec(rank, size, host, port, config, source.path, load_weights,
                                                    local_device_index=rank) for rank in range(1, size)])
            platform = current_platform()
            self.group = init_distributed(0, size, host, port, device=platform.device,
                                          check_peers=self._raise_if_a_rank_failed)
            self.runner = ModelRunner(config, source.hf_config, platform,
                                      source if load_weights else None, self.group)
            while not all(rank.ready for rank in self.ranks):
                self._raise_if_a_rank_failed()
                time.sleep(0.02)
        except BaseException as exc:
            failed = self._first_failure()
            self.shutdown()
            if failed is not None and not isinstance(exc, RankFailedError):
                raise RankFailedError(f"tensor-parallel start failed: {failed}") from exc
            raise
        self.kv_cache_config = self.runner.kv_cache_config
        logger.info("%s executor: %d ranks (rank 0 in the engine core's process)", self.name, size)

    def rendezvous_host(self) -> str:
        """The address the other ranks reach rank 0's rendezvous store at."""
        return "127.0.0.1"

    @abstractmethod
    def start_ranks(self, specs: list[RankSpec]) -> list[RankHandle]:
        """Start ranks 1..N-1 (they then meet rank 0 at the rendezvous)."""

    # ------------------------------------------------------------------------- failures
    def _first_failure(self) -> str | None:
        for rank in self.ranks:
            failure = rank.failure()
            if failure is not None:
                return f"rank {rank.rank}: {failure}"
        return None

    def _raise_if_a_rank_failed(self) -> None:
        failed = self._first_failure()
        if failed is not None:
            raise RankFailedError(f"tensor-parallel start failed: {failed}")

    def _call(self, method: str, step: int, payload: Any, local):
        """Send the call to every other rank, then make it here; a collective that found a peer
        gone becomes a RankFailedError naming it."""
        for rank in self.ranks:
            rank.send((method, step, payload))
        try:
            return local()
        except RuntimeError as exc:
            failed = self._first_failure()
            if failed is None:
                raise
            raise RankFailedError(f"tensor-parallel {failed}; the engine cannot continue") from exc

    # ---------------------------------------------------------------------------- steps
    def execute_model(self, plan: SchedulerPlan) -> ForwardStep:
        # Every rank's runner numbers its steps alike (the same calls in the same order): the
        # number is sent ahead, so a rank can check it runs the step rank 0 runs.
        step = next(self._step_ids)
        forward = self._call("execute_model", step, plan, lambda: self.runner.forward(plan))
        assert forward.step_id == step, (forward.step_id, step)
        return forward

    def sample_tokens(self, forward: ForwardStep, grammar: GrammarOutput | None) -> LaunchedStep:
        return self._call("sample_tokens", forward.step_id, grammar, lambda: self.runner.sample(forward, grammar))

    def collect(self, launched: LaunchedStep) -> RunnerResult:
        return self._call("collect", launched.step_id, None, lambda: self.runner.collect(launched))

    def profile_verify_step(self, num_seqs: int, num_query: int) -> float:
        return self._call("profile_verify_step", 0, (num_seqs, num_query),
                          lambda: self.runner.profile_verify_step(num_seqs, num_query))

    def propose_mtp(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        return self._call("propose_mtp", 0, list(requests), lambda: self.runner.propose_mtp(requests))

    # -------------------------------------------------------------------------- the end
    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.stop()
        self.ranks = []
        if self.runner is not None:
            super().shutdown()
        if self.group is not None:
            shutdown_distributed(self.group)
            self.group = None
