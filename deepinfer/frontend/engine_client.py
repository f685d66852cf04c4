"""The server's async client of the engine core process.

    await client.start()                       # spawn the core, wait for its Ready
    async for out in client.generate(ids, params):   # RequestOutput deltas of one request
        ...
    client.abort(request_id)                   # also done for you when the consumer goes away

What happens here and not in the core: detokenization, stop strings and n > 1 fan-out (the
OutputProcessor), per-request asyncio queues, the pending-request limit (backpressure), and
metrics intervals. One task reads the core's output socket and dispatches; a watchdog task
turns a dead core process into `EngineDeadError` for every waiting request and an unhealthy
/health, so nothing ever waits on a core that is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from deepinfer import envs
from deepinfer.config import EngineConfig, resolve_max_model_len
from deepinfer.engine.core import EngineStats
from deepinfer.engine.core_proc import (
    Abort, AddRequest, Failed, OutputMessage, Ready, Shutdown, StepOutputs, run_engine_core,
)
from deepinfer.kv_cache.prefix_cache import extra_key
from deepinfer.metrics.prometheus import ServerMetrics
from deepinfer.metrics.stats import RequestTimings
from deepinfer.models.loader import ModelSource
from deepinfer.output_processor import OutputProcessor
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 10.0
# The core sends something at least every HEARTBEAT_S (0.5 s) when idle and after every step;
# this much silence means it is stuck (one CPU step of a large prefill takes seconds, not this).
HEARTBEAT_STALE_S = 60.0


class EngineDeadError(RuntimeError):
    """The engine core process is gone; the server can no longer generate."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (its client went away) while someone still waited on it."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (e.g. its grammar did not compile in time)."""


class ServerBusyError(RuntimeError):
    """The pending-request limit is reached (HTTP 429)."""


@dataclass
class _Tracked:
    queue: asyncio.Queue
    timings: RequestTimings
    child_ids: list[str]
    stopped: set[str] = field(default_factory=set)   # children ended by a stop sequence upstream


@dataclass
class EngineInfo:
    model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    started: float = field(default_factory=time.time)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, source: ModelSource, *, max_pending_requests: int = 1024,
                 metrics_vllm_names: bool = False) -> None:
        self.config = config
        self.tokenizer = source.tokenizer
        self.vocab_size = source.hf_config["vocab_size"]
        self.model_id = config.model.served_model_name or source.name
        self.max_pending_requests = max_pending_requests
        self.output_processor = OutputProcessor(self.tokenizer)
        # The core resolves max_model_len the same way; the token histograms' buckets need it now.
        self.metrics = ServerMetrics(self.model_id, resolve_max_model_len(config, source.hf_config),
                                     engine_healthy=lambda: self.healthy, vllm_names=metrics_vllm_names)
        self.info: EngineInfo | None = None
        self.last_stats: EngineStats | None = None
        self.dead_reason: str | None = None
        self._requests: dict[str, _Tracked] = {}
        self._parent_of: dict[str, str] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(OutputMessage)
        self._tasks: list[asyncio.Task] = []
        self._proc = None
        self._ipc_dir = None
        self._last_heartbeat = time.monotonic()

    # ------------------------------------------------------------------------ lifecycle
    async def start(self, timeout_s: float = 900.0) -> EngineInfo:
        self._ipc_dir = tempfile.mkdtemp(prefix="deepinfer-ipc-")
        input_address = f"ipc://{self._ipc_dir}/input"
        output_address = f"ipc://{self._ipc_dir}/output"
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)   # never block the event loop on a send
        self._input.bind(input_address)
        self._async_ctx = zmq.asyncio.Context()
        self._output = self._async_ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(output_address)
        # spawn, not fork: the front end may already hold threads (uvicorn, tokenizers).
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(self.config, input_address, output_address, envs.log_level()),
            name="deepinfer-engine-core", daemon=True)
        self._proc.start()
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self._proc.exitcode} "
                                   "while loading the model (see its log above)")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the engine core was not ready after {timeout_s:.0f} s")
            if not await self._output.poll(1000):
                continue
            message = self._decoder.decode(await self._output.recv())
            if isinstance(message, Failed):
                raise RuntimeError(f"the engine core failed to start:\n{message.error}")
            if isinstance(message, Ready):
                self.info = EngineInfo(self.model_id, message.max_model_len, message.num_kv_blocks,
                                       message.block_size)
                self.metrics.engine_started(self.config.cache, message.num_kv_blocks, message.pid)
                break
        self._last_heartbeat = time.monotonic()
        self._tasks = [asyncio.create_task(self._output_loop(), name="engine-outputs"),
                       asyncio.create_task(self._watchdog(), name="engine-watchdog")]
        logger.info("engine core ready (pid %s): %s, max_model_len=%d, %d KV blocks of %d tokens",
                    self._proc.pid, self.model_id, self.info.max_model_len, self.info.num_kv_blocks,
                    self.info.block_size)
        return self.info

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._proc is not None and self._proc.is_alive():
            try:
                self._input.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
        self._fail_all(EngineDeadError("the server is shutting down"))
        for ctx in (getattr(self, "_sync_ctx", None), getattr(self, "_async_ctx", None)):
            if ctx is not None:
                ctx.destroy(linger=0)
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def healthy(self) -> bool:
        """The core process is alive and not silent; /health reports this."""
        return self.alive and time.monotonic() - self._last_heartbeat < HEARTBEAT_STALE_S

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self._proc is not None and self._proc.is_alive()

    @property
    def unhealthy_reason(self) -> str | None:
        if self.healthy:
            return None
        if not self.alive:
            return self.dead_reason or "the engine core is not running"
        return f"the engine core has sent nothing for {time.monotonic() - self._last_heartbeat:.0f} s"

    @property
    def num_pending(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------------- requests
    def new_request_id(self) -> str:
        # Random, so ids (which become response ids) do not reveal traffic volume.
        return secrets.token_hex(12)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                 prompt: str | None = None, priority: int = 0,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request now (so a full queue or a dead engine raises here, before any HTTP
        response starts) and return an iterator of its DELTA RequestOutputs until it finishes.

        Closing the iterator early (the HTTP client went away, or the caller saw enough)
        aborts the request in the core, which frees its KV blocks."""
        request_id = request_id or self.new_request_id()
        tracked = self.add_request(request_id, prompt_token_ids, params, prompt=prompt, priority=priority,
                                   cache_salt=cache_salt)
        return self._iterate(request_id, tracked)

    async def _iterate(self, request_id: str, tracked: _Tracked) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await tracked.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
                if item.finished:
                    return
        finally:
            if request_id in self._requests:
                self.abort(request_id)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, priority: int = 0, cache_salt: str | None = None) -> _Tracked:
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the engine core is not running")
        if len(self._requests) >= self.max_pending_requests:
            raise ServerBusyError(f"the server has {len(self._requests)} requests in flight, its limit "
                                  f"(--max-pending-requests); retry later")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        room = self.info.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        child_ids = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        timings = RequestTimings(len(prompt_token_ids), n=len(child_ids), max_tokens=max_tokens)
        tracked = _Tracked(asyncio.Queue(), timings, child_ids)
        self._requests[request_id] = tracked
        key = extra_key(self.model_id, cache_salt)
        eos = sorted(self.tokenizer.eos_token_ids)
        for index, child_id in enumerate(child_ids):
            self._parent_of[child_id] = request_id
            child_params = params.for_child(index) if params.n > 1 else params
            self._send(AddRequest(child_id, prompt_token_ids, child_params, eos, max_tokens, priority,
                                  cache_salt, key, params.prompt_logprobs is not None))
        return tracked

    def abort(self, request_id: str) -> None:
        """Forget a request and free its KV blocks in the core (no-op when already done)."""
        tracked = self._requests.pop(request_id, None)
        core_ids = self.output_processor.abort(request_id)
        if tracked is not None:
            for child_id in tracked.child_ids:
                self._parent_of.pop(child_id, None)
            self.metrics.record_finished(tracked.timings, "abort")
            tracked.queue.put_nowait(RequestAbortedError(f"request {request_id} was aborted"))
        if core_ids and self.alive:
            self._send(Abort(core_ids))

    def abort_child(self, request_id: str, index: int) -> None:
        """Stop one of a request's n sequences (the protocol layer saw a stop sequence in it).

        The core answers with an "abort" output for that child, which finishes it here."""
        tracked = self._requests.get(request_id)
        if tracked is not None and 0 <= index < len(tracked.child_ids) and self.alive:
            tracked.stopped.add(tracked.child_ids[index])
            self._send(Abort([tracked.child_ids[index]]))

    def _send(self, message) -> None:
        self._input.send(self._encoder.encode(message), zmq.NOBLOCK)

    # -------------------------------------------------------------------------- outputs
    async def _output_loop(self) -> None:
        try:
            while True:
                message = self._decoder.decode(await self._output.recv())
                self._last_heartbeat = time.monotonic()
                if isinstance(message, Failed):
                    self._die(f"the engine core crashed:\n{message.error}")
                    return
                if isinstance(message, StepOutputs):
                    self._dispatch(message)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave requests waiting forever
            logger.exception("engine output loop failed")
            self._die(f"the engine output loop failed: {e!r}")

    def _dispatch(self, message: StepOutputs) -> None:
        self.last_stats = message.stats
        self.metrics.record_engine_stats(message.stats, message.iteration_tokens)
        for child_id, times in message.finished_times.items():
            tracked = self._requests.get(self._parent_of.get(child_id, ""))
            if tracked is not None:
                tracked.timings.on_core_finished(tracked.child_ids.index(child_id), times)
        if not message.outputs:
            return
        processed = self.output_processor.process(message.outputs)
        if processed.abort_ids:   # stop strings found here: the core must stop those children
            self._send(Abort(processed.abort_ids))
        now = time.monotonic()
        for out in processed.request_outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:
                continue
            timings = tracked.timings
            new_per_sequence = [len(c.token_ids) for c in out.outputs]   # ordered by index, all n
            num_new = sum(new_per_sequence)
            first = timings.first_token is None and num_new > 0
            interval = timings.on_tokens(new_per_sequence, now)
            if first:
                self.metrics.record_first_output(timings)
            if num_new:
                self.metrics.record_tokens(num_new, interval)
            tracked.queue.put_nowait(out)
            if out.finished:
                timings.finished = now
                # The core says "abort" for children stopped upstream (a stop sequence): a stop.
                reasons = {"stop" if child in tracked.stopped else c.finish_reason
                           for child, c in zip(tracked.child_ids, out.outputs)}
                reason = "abort" if "abort" in reasons else "length" if "length" in reasons else "stop"
                self.metrics.record_finished(timings, reason)
                del self._requests[out.request_id]
                for child_id in tracked.child_ids:
                    self._parent_of.pop(child_id, None)

    # ---------------------------------------------------------------------------- health
    async def _watchdog(self) -> None:
        last_log = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            if not self._proc.is_alive():
                self._die(f"the engine core process exited unexpectedly (exit code {self._proc.exitcode})")
                return
            now = time.monotonic()
            if now - last_log >= STATS_LOG_INTERVAL_S and self.last_stats is not None:
                last_log = now
                s = self.last_stats
                level = logging.INFO if s.num_running or s.num_waiting else logging.DEBUG
                logger.log(level, "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, in flight here: %d",
                           s.num_running, s.num_waiting, 100 * s.kv_cache_usage, len(self._requests))
                if s.spec_decode is not None and s.spec_decode.num_drafts:
                    logger.log(level, "Speculative decoding: %s", s.spec_decode.summary())

    def _die(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("%s", reason)
            self.dead_reason = reason.splitlines()[0]
        self._fail_all(EngineDeadError(self.dead_reason))

    def _fail_all(self, error: Exception) -> None:
        for tracked in self._requests.values():
            tracked.queue.put_nowait(error)
        self._requests.clear()
        self._parent_of.clear()
