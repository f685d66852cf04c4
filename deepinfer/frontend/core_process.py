"""The engine core process as the front end sees it: spawn, handshake, sockets, liveness.

    core = CoreProcess(config); info = await core.start()   # spawn, wait for Ready
    core.send(AddRequest(...)); message = await core.recv()
    core.silent_for()  # seconds since the core last said anything (heartbeats included)

With data parallelism the client holds one CoreProcess per rank, each with its own sockets.
Each CoreProcess is used once: when a core dies or stalls the client kills it and starts a new
one on fresh sockets, so nothing the old core left queued can reach the new one.

The core sends a Heartbeat from a thread of its own every HEARTBEAT_S, also while a long step
runs, so silence means the process is stopped or frozen (SIGSTOP, a hung driver call holding
the interpreter), not busy.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
import time

import msgspec
import zmq
import zmq.asyncio

from deepinfer import envs
from deepinfer.config import EngineConfig
from deepinfer.engine.core_proc import Failed, OutputMessage, Ready, Shutdown, run_engine_core

logger = logging.getLogger(__name__)


class CoreStartError(RuntimeError):
    """The core process exited or failed while loading the model."""


class CoreProcess:
    def __init__(self, config: EngineConfig, *, load_weights: bool = True, data_parallel_rank: int = 0,
                 env: dict[str, str] | None = None) -> None:
        """`env`: variables the core sets in its own process before it starts (its CUDA devices)."""
        self.config = config
        self.load_weights = load_weights
        self.data_parallel_rank = data_parallel_rank
        self.env = env or {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(OutputMessage)
        self._ipc_dir = tempfile.mkdtemp(prefix="deepinfer-ipc-")
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)   # never block the event loop on a send
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(f"ipc://{self._ipc_dir}/input")
        self._async_ctx = zmq.asyncio.Context()
        self._output = self._async_ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(f"ipc://{self._ipc_dir}/output")
        # The same socket seen synchronously, to drain what is queued without awaiting.
        self._output_now = zmq.Socket.shadow(self._output.underlying)
        self.process = None
        self.last_message = time.monotonic()

    async def start(self, timeout_s: float) -> Ready:
        # spawn, not fork: the front end already holds threads (uvicorn, tokenizers).
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(self.config, f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output", envs.log_level(),
                  self.load_weights, self.data_parallel_rank, self.env),
            name=f"deepinfer-engine-core-{self.data_parallel_rank}", daemon=True)
        self.process.start()
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.process.is_alive():
                raise CoreStartError(f"the engine core process exited with code {self.process.exitcode} "
                                     "while loading the model (see its log above)")
            if time.monotonic() > deadline:
                self.kill()
                raise CoreStartError(f"the engine core was not ready after {timeout_s:.0f} s")
            if not await self._output.poll(1000):
                continue
            message = self._decoder.decode(await self._output.recv())
            if isinstance(message, Failed):
                raise CoreStartError(f"the engine core failed to start:\n{message.error}")
            if isinstance(message, Ready):
                self.last_message = time.monotonic()
                return message

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return None if self.process is None else self.process.exitcode

    def silent_for(self) -> float:
        return time.monotonic() - self.last_message

    def encode(self, message) -> bytes:
        return self._encoder.encode(message)

    def send(self, message) -> None:
        self.send_encoded(self._encoder.encode(message))

    def send_encoded(self, raw: bytes) -> None:
        self._input.send(raw, zmq.NOBLOCK)

    async def recv(self):
        """The next message; returns as soon as one is there."""
        message = self._decoder.decode(await self._output.recv())
        self.last_message = time.monotonic()
        return message

    def recv_ready(self) -> list:
        """Every message already waiting, without waiting (the coalescing drain)."""
        messages = []
        while True:
            try:
                raw = self._output_now.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            messages.append(self._decoder.decode(raw))
        if messages:
            self.last_message = time.monotonic()
        return messages

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def shutdown(self) -> None:
        """Ask the core to stop, wait a little, then make sure; close the sockets."""
        if self.process is not None and self.process.is_alive():
            try:
                self.send(Shutdown())
            except zmq.ZMQError:
                pass
            self.process.join(5)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)
            self.kill()
        self.close()

    def close(self) -> None:
        for ctx in (self._sync_ctx, self._async_ctx):
            ctx.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
