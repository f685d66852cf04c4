"""The `mp` executor: tensor-parallel ranks on this host, one process each.

Rank 0 runs in the engine core's process (ranked.py says how the ranks work together and fail);
ranks 1..N-1 are child processes (`python -m deepinfer.worker.rank_worker`), each reached
through a connection of its own, in order.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from deepinfer import envs
from deepinfer.executor.ranked import RankedExecutor, RankFailedError, RankHandle
from deepinfer.worker.rank_worker import RANK_TOKEN_ENV, RankSpec, receive_message, send_message

RANK_EXIT_WAIT_S = 10.0
RANK_CONNECT_TIMEOUT_S = 120.0   # a rank's interpreter and torch import, on a loaded machine


class _RankProcess(RankHandle):
    """Rank 0's view of one rank: its process and the connection its calls go through.

    The rank is a plain child process (`python -m deepinfer.worker.rank_worker`), not a
    multiprocessing one: the server's engine core is a daemonic process, and those may not have
    multiprocessing children. It connects back over loopback and proves itself with a token
    only its environment carries; then its RankSpec crosses, pickled, like every call after it."""

    def __init__(self, spec: RankSpec, listener: socket.socket) -> None:
        self.rank = spec.rank
        token = secrets.token_hex(16)
        # The folder holding the deepinfer package (this file is deepinfer/executor/multiproc.py).
        package_root = str(Path(__file__).resolve().parents[2])
        env = envs.child_env({RANK_TOKEN_ENV: token}, python_path=[package_root])
        host, port = listener.getsockname()[:2]
        self.process = subprocess.Popen([sys.executable, "-m", "deepinfer.worker.rank_worker", host, str(port)],
                                        env=env, stdin=subprocess.DEVNULL)
        self.conn = self._accept(listener, token)
        send_message(self.conn, spec)
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
            if conn.poll(RANK_CONNECT_TIMEOUT_S) and receive_message(conn) == token:
                return conn
            conn.close()   # not our rank: someone else on loopback

    def failure(self) -> str | None:
        """What went wrong with this rank, if anything: its report, or how its process ended."""
        try:
            while self.conn.poll():
                kind, message, _trace = receive_message(self.conn)
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
            send_message(self.conn, message)
        except (BrokenPipeError, OSError) as exc:
            raise RankFailedError(f"tensor-parallel rank {self.rank} is gone: {self.failure() or exc}") from exc

    def stop(self) -> None:
        try:
            send_message(self.conn, ("shutdown", 0, None))
        except OSError:
            pass
        try:
            self.process.wait(RANK_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(RANK_EXIT_WAIT_S)
        self.conn.close()


class MultiprocExecutor(RankedExecutor):
    """Ranks 1..N-1 as child processes of the engine core, on this host."""

    name = "mp"

    def start_ranks(self, specs: list[RankSpec]) -> list[RankHandle]:
        ranks: list[RankHandle] = []
        with socket.create_server(("127.0.0.1", 0)) as listener:
            listener.settimeout(0.1)
            for spec in specs:
                ranks.append(_RankProcess(spec, listener))
                self.ranks = ranks   # started ones are stopped if a later one fails
        return ranks
