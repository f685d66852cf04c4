"""The `mp` executor: tensor-parallel ranks on this host, one process each.

Rank 0's ModelRunner runs in the engine core's own process, as the in-process executor's does, so
one rank costs nothing more than `uni`; ranks 1..N-1 are child processes
(worker/rank_worker.py). Each executor call is sent to every other rank through its pipe first,
then made on rank 0: all ranks run the same plan at once and meet in the layers' collectives
(gloo on CPU, NCCL on CUDA). The scheduler reads rank 0's results only.

Failures: a rank that fails to start reports its error, and rank 0 raises it (naming the rank)
instead of waiting at the rendezvous. A rank that dies later closes its sockets, so rank 0's next
collective fails at once; the executor then raises `RankFailedError` with that rank's exit code
and last words, the engine core's step fails, and the server's supervision takes over (health
503, restart). Nothing waits forever: a rank that hangs is bounded by the group's timeout.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import deepinfer
from deepinfer.config import EngineConfig
from deepinfer.distributed import init_distributed, shutdown_distributed
from deepinfer.engine.plan import ForwardStep, GrammarOutput, LaunchedStep, RunnerResult, SchedulerPlan
from deepinfer.executor.uniproc import UniProcExecutor
from deepinfer.platforms import current_platform
from deepinfer.worker.model_runner import ModelRunner
from deepinfer.worker.rank_worker import RANK_TOKEN_ENV, RankSpec

if TYPE_CHECKING:
    from deepinfer.models.loader import ModelSource
    from deepinfer.spec_decode.drafter import Draft, DraftRequest

logger = logging.getLogger(__name__)

RANK_EXIT_WAIT_S = 10.0
RANK_CONNECT_TIMEOUT_S = 120.0   # a rank's interpreter and torch import, on a loaded machine


class RankFailedError(RuntimeError):
    """A tensor-parallel rank other than 0 failed or died; the engine cannot go on."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _RankProcess:
    """Rank 0's view of one rank: its process and the connection its calls go through.

    The rank is a plain child process (`python -m deepinfer.worker.rank_worker`), not a
    multiprocessing one: the server's engine core is a daemonic process, and those may not have
    multiprocessing children. It connects back over loopback and proves itself with a token
    only its environment carries; then its RankSpec crosses, pickled, like every call after it."""

    def __init__(self, spec: RankSpec, listener: socket.socket) -> None:
        self.rank = spec.rank
        token = secrets.token_hex(16)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(deepinfer.__file__)))
        env = {**os.environ, RANK_TOKEN_ENV: token,
               "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        host, port = listener.getsockname()[:2]
        self.process = subprocess.Popen([sys.executable, "-m", "deepinfer.worker.rank_worker", host, str(port)],
                                        env=env, stdin=subprocess.DEVNULL)
        self.conn = self._accept(listener, token)
        self.conn.send(spec)
        self.ready = False

    def _accept(self, listener: socket.socket, token: str) -> Connection:
        deadline = time.monotonic() + RANK_CONNECT_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RankFailedError(f"tensor-parallel rank {self.rank} exited with code "
                                      f"{self.process.returncode} before it connected")
            if time.monotonic() > deadline:
                raise RankFailedError(f"tensor-parallel rank {self.rank} did not connect within "
                                      f"{RANK_CONNECT_TIMEOUT_S:.0f} s")
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            sock.setblocking(True)
            conn = Connection(sock.detach())
            if conn.poll(RANK_CONNECT_TIMEOUT_S) and conn.recv() == token:
                return conn
            conn.close()   # not our rank: someone else on loopback

    def failure(self) -> str | None:
        """What went wrong with this rank, if anything: its report, or how its process ended."""
        try:
            while self.conn.poll():
                kind, message, _trace = self.conn.recv()
                if kind == "failed":
                    return message
                if kind == "ready":
                    self.ready = True
        except (EOFError, OSError):
            pass
        if self.process.poll() is not None:
            return f"its process exited with code {self.process.returncode}"
        return None

    def send(self, message: tuple[str, int, Any]) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise RankFailedError(f"tensor-parallel rank {self.rank} is gone: {self.failure() or exc}") from exc


class MultiprocExecutor(UniProcExecutor):
    """Rank 0 in this process (UniProcExecutor's runner), the other ranks in their own."""

    def __init__(self, config: EngineConfig, source: ModelSource, *, load_weights: bool = True) -> None:
        size, host = config.parallel.world_size, "127.0.0.1"
        port = free_port(host)
        self.ranks: list[_RankProcess] = []
        self.group = None
        self.runner = None
        self._step_ids = itertools.count()
        try:
            with socket.create_server((host, 0)) as listener:
                listener.settimeout(0.1)
                for rank in range(1, size):
                    self.ranks.append(_RankProcess(RankSpec(rank, size, host, port, config, source.path,
                                                            load_weights, local_device_index=rank), listener))
            platform = current_platform()
            self.group = init_distributed(0, size, host, port, device=platform.device,
                                          check_peers=self._raise_if_a_rank_failed)
            self.runner = ModelRunner(config, source.hf_config, platform,
                                      source if load_weights else None, self.group)
            self._wait_ready()
        except BaseException as exc:
            failed = self._first_failure()
            self.shutdown()
            if failed is not None and not isinstance(exc, RankFailedError):
                raise RankFailedError(f"tensor-parallel start failed: {failed}") from exc
            raise
        self.kv_cache_config = self.runner.kv_cache_config
        logger.info("mp executor: %d ranks on this host (rank 0 in the engine core's process)", size)

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

    def _wait_ready(self) -> None:
        for rank in self.ranks:
            while not rank.ready:
                self._raise_if_a_rank_failed()
                if rank.conn.poll(0.05):
                    kind, message, _ = rank.conn.recv()
                    if kind == "failed":
                        raise RankFailedError(f"tensor-parallel start failed: rank {rank.rank}: {message}")
                    rank.ready = kind == "ready"

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
            try:
                rank.conn.send(("shutdown", 0, None))
            except OSError:
                pass
        for rank in self.ranks:
            try:
                rank.process.wait(RANK_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                rank.process.kill()
                rank.process.wait(RANK_EXIT_WAIT_S)
            rank.conn.close()
        self.ranks = []
        if self.runner is not None:
            super().shutdown()
        if self.group is not None:
            shutdown_distributed(self.group)
            self.group = None
