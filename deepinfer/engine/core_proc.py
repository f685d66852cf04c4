"""The engine core in its own process, behind two ZMQ sockets (the server's side of DESIGN rule 7).

    front end --PUSH--> [input]  AddRequest | Abort | Shutdown      --PULL--> core process
    front end <--PULL-- [output] Ready | Failed | StepOutputs      <--PUSH-- core process

The front end binds both sockets (it outlives the core) and the core connects. Messages are
msgspec msgpack; the engine's own dataclasses (SamplingParams, EngineCoreOutput, EngineStats,
RequestTimes) travel as they are, so there is no second schema to keep in step.

The busy loop never waits on the front end: while requests are unfinished it drains whatever
input is queued without blocking, steps once, and pushes that step's outputs. When idle it
blocks on the input socket for at most HEARTBEAT_S, then pushes an empty StepOutputs, which is
the heartbeat the front end's health check and metrics gauges rely on.

A thread of its own sends a Heartbeat every HEARTBEAT_S on a second socket, also while the
loop is inside a long step, with how long the loop has been in its current iteration: silence
means the process is stopped or frozen, a growing `busy_for_s` that one step never ends.

With data parallelism (`data_parallel_size` N) the server runs N of these processes, each on
sockets of its own, with its rank (0..N-1) in its KV events and its log lines.

Handshake: the core loads the model, then sends Ready (or Failed with the error text). Any
exception in the loop is sent as Failed before the process exits with status 1, so a crashed
core turns into an unhealthy server, never a hung request.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from typing import Union

import msgspec
import zmq

from deepinfer import envs
from deepinfer.config import EngineConfig
from deepinfer.engine.admission import AddRequest, to_request
from deepinfer.engine.profiling import CoreProfiler
from deepinfer.types.plan import EngineCoreOutput, EngineStats
from deepinfer.types.request import Request, RequestTimes

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5


# ------------------------------------------------------------------------------ messages in
# AddRequest (engine/admission.py): one child request, as admission resolved it.


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Profile(msgspec.Struct, tag="profile"):
    """Start (or stop) the torch profiler on this core (engine/profiling.py)."""
    start: bool


InputMessage = Union[AddRequest, Abort, Shutdown, Profile]


# ----------------------------------------------------------------------------- messages out
class Ready(msgspec.Struct, tag="ready"):
    model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    pid: int


class Failed(msgspec.Struct, tag="failed"):
    error: str


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    busy_for_s: float   # how long the busy loop has been in its current iteration


class StepOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: EngineStats
    # Core-clock timestamps of requests that finished this step, for queue/prefill/decode
    # intervals. The front end only subtracts these from each other, never from its own clock.
    finished_times: dict[str, RequestTimes] = {}
    # Tokens of each engine step whose outputs this message carries (vLLM's iteration_tokens_total):
    # see step_tokens().
    iteration_tokens: list[int] = []


OutputMessage = Union[Ready, Failed, Heartbeat, StepOutputs]


# ------------------------------------------------------------------------------- the process
class EngineCoreProc:
    """Owns an EngineCore and the two sockets; `run()` is the busy loop."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str, block_size: int,
                 load_weights: bool = True, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.load_weights = load_weights
        self.data_parallel_rank = data_parallel_rank
        self.block_size = block_size
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_address)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)  # let the last Failed/outputs leave on exit
        # Unbounded: a front end that falls behind must never block the step loop (it drains
        # and coalesces what queued up; frontend/output_stream.py).
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.connect(output_address)
        self.output_address = output_address
        self.iteration_started = time.monotonic()
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.core = None
        # Requests still in the core, kept to read their timestamps when they finish.
        self.requests: dict[str, Request] = {}
        self.parent_pid = os.getppid()
        directory = envs.torch_profiler_dir()
        self.profiler = CoreProfiler(directory) if directory else None

    def send(self, message: OutputMessage) -> None:
        self.output.send(self.encoder.encode(message))

    def load(self) -> None:
        from deepinfer.engine.core import EngineCore
        from deepinfer.models.loader import model_source

        source = model_source(self.config.model)
        if not self.load_weights:
            import torch

            # Random weights from the engine seed: every server of one shape holds the same
            # ones, so KV one computed into a shared store is valid for another.
            torch.manual_seed(self.config.model.seed)
        self.core = EngineCore(self.config, source, load_weights=self.load_weights, offline=False,
                               data_parallel_rank=self.data_parallel_rank)
        name = self.config.model.served_model_name or source.name
        self.send(Ready(name, self.core.max_model_len, self.core.num_kv_blocks, self.block_size, os.getpid()))

    def start_heartbeat(self) -> None:
        def beat() -> None:
            socket = self.ctx.socket(zmq.PUSH)   # a socket belongs to one thread
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.output_address)
            encoder = msgspec.msgpack.Encoder()
            try:
                while True:
                    time.sleep(HEARTBEAT_S)
                    socket.send(encoder.encode(Heartbeat(time.monotonic() - self.iteration_started)))
            except zmq.ContextTerminated:
                socket.close()

        threading.Thread(target=beat, name="core-heartbeat", daemon=True).start()

    def run(self) -> None:
        core = self.core
        pending: list[EngineCoreOutput] = []   # abort outputs to report with the next step
        iteration_tokens: list[int] = []       # per step, until published
        last_sent = time.monotonic()
        while True:
            self.iteration_started = time.monotonic()
            busy = core.has_unfinished()
            timeout_ms = 0 if busy else int(HEARTBEAT_S * 1000)
            # Drain everything queued; block only while there is nothing to compute.
            while self.input.poll(timeout_ms):
                timeout_ms = 0
                message = self.decoder.decode(self.input.recv())
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, Abort):
                    pending.extend(core.abort(message.request_ids))
                elif isinstance(message, Profile):
                    self._profile(message.start)
                else:
                    self._add(message, pending)
            if self.profiler is not None:
                self.profiler.check_limit()
            outputs = core.step() if core.has_unfinished() else []
            if any(out.new_token_ids for out in outputs):
                iteration_tokens.append(step_tokens(outputs, self.requests))
            if busy and not core.has_unfinished():
                core.check_idle()
            outputs = pending + outputs
            pending = []
            now = time.monotonic()
            if outputs or now - last_sent >= HEARTBEAT_S:
                self._publish(outputs, iteration_tokens)
                iteration_tokens = []
                last_sent = now
            if not busy and os.getppid() != self.parent_pid:
                logger.warning("the front end process is gone; engine core exiting")
                return

    def _profile(self, start: bool) -> None:
        if self.profiler is None:
            logger.warning("profiler: no DEEPINFER_TORCH_PROFILER_DIR in the engine core's environment")
        elif start:
            self.profiler.start()
        else:
            self.profiler.stop()

    def _add(self, message: AddRequest, pending: list[EngineCoreOutput]) -> None:
        try:
            request = to_request(message, self.block_size)
            self.core.add_request(request)
        except Exception:  # the front end validates; this is a last line, not a crash
            logger.exception("engine core rejected request %s", message.request_id)
            pending.append(EngineCoreOutput(message.request_id, [], finish_reason="abort"))
            return
        self.requests[message.request_id] = request

    def _publish(self, outputs: list[EngineCoreOutput], iteration_tokens: list[int]) -> None:
        finished_times = {}
        for out in outputs:
            if out.finished:
                request = self.requests.pop(out.request_id, None)
                if request is not None:
                    finished_times[out.request_id] = request.times
        self.send(StepOutputs(outputs, self.core.stats(), finished_times, iteration_tokens))


def step_tokens(outputs: list[EngineCoreOutput], requests: dict[str, Request]) -> int:
    """Tokens of one engine step as vLLM counts them for iteration_tokens_total: every token the
    step generated, plus the whole prompt of each request whose first token it produced (a
    chunked prefill counts at its last chunk). Called before `requests` forgets the finished."""
    total = 0
    for out in outputs:
        total += len(out.new_token_ids)
        request = requests.get(out.request_id)
        if request is not None and out.new_token_ids and request.num_output_tokens == len(out.new_token_ids):
            total += request.num_prompt_tokens
    return total


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, log_level: str,
                    load_weights: bool = True, data_parallel_rank: int = 0, env: dict[str, str] | None = None) -> None:
    """Entry point of the core process (multiprocessing target). `data_parallel_rank`: this core's
    index behind the server; `env`: variables to set before anything starts CUDA (its devices:
    frontend/dp_balancer.py core_device_env)."""
    envs.set_env(env or {})
    name = "core" if config.parallel.data_parallel_size == 1 else f"core {data_parallel_rank}"
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s [{name}] [%(name)s] %(message)s")
    if env:
        logger.info("data-parallel rank %d: %s", data_parallel_rank, " ".join(f"{k}={v}" for k, v in env.items()))
    # SIGTERM from the front end ends the loop through SystemExit, closing sockets cleanly.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which shuts us down
    proc = EngineCoreProc(config, input_address, output_address, config.cache.block_size, load_weights,
                          data_parallel_rank)
    try:
        proc.load()
        proc.start_heartbeat()
        proc.run()
    except SystemExit:
        pass
    except BaseException:
        error = traceback.format_exc()
        logger.error("engine core failed:\n%s", error)
        try:
            proc.send(Failed(error))
        finally:
            proc.ctx.destroy(linger=2000)
        os._exit(1)
    if proc.core is not None:
        proc.core.shutdown()
    proc.ctx.destroy(linger=1000)
