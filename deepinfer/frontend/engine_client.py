"""The server's async client of the engine core process.

    await client.start()                       # spawn the core, wait for its Ready
    async for out in client.generate(ids, params):   # RequestOutput deltas of one request
        ...
    out = await client.embed(ids, PoolingParams())    # one EmbeddingRequestOutput
    client.abort(request_id)                   # also done for you when the consumer goes away

What happens here and not in the core: detokenization, stop strings and n > 1 fan-out (the
OutputProcessor), per-request output streams, the pending-request limit (backpressure),
request deadlines and metrics intervals.

One task reads the core's output socket. It takes every message already queued at once and
processes them together, so a front end that fell behind turns several steps' tokens into one
output per request (frontend/output_stream.py coalesces further until the handler runs).

A watchdog task supervises the core: a dead core, or one silent for ENGINE_STALL_S (its
heartbeat thread stopped: SIGSTOP, a frozen process), fails every waiting request with
EngineDeadError and makes /health unhealthy at once; a dead core, or one stalled for
ENGINE_STALL_RESTART_S, is killed and started again, at most `max_engine_restarts` times, after
which `on_fatal` is called (the server then exits non-zero for its supervisor to see).

Data parallelism (`data_parallel_size` N): N engine cores, one `_Engine` each (rank = index), each
with its own process, sockets, output task, stats and restart count. A request goes to one core
for its whole life, its n > 1 children with it (frontend/dp_balancer.py picks the least loaded
healthy core). Everything above holds per core: a core that dies or stalls fails only its own
requests and is restarted (at most `max_engine_restarts` times each) while the others keep serving;
new requests are refused (503) only when no core is healthy. /health is unhealthy while any core
is (a router in front should see a replica that runs short of capacity); /metrics labels every
series with the core's index.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from deepinfer.config import EngineConfig, resolve_max_model_len
from deepinfer.engine.admission import AddRequest, EngineFacts, child_requests, pooling_request
from deepinfer.engine.core_proc import Abort, Failed, Heartbeat, Profile, StepOutputs
from deepinfer.frontend.core_process import CoreProcess
from deepinfer.frontend.dp_balancer import DPLoadBalancer, core_device_env
from deepinfer.frontend.output_stream import OutputStream
from deepinfer.metrics.prometheus import ServerMetrics
from deepinfer.metrics.stats import RequestTimings
from deepinfer.models.loader import ModelSource
from deepinfer.multimodal.inputs import ImageInputs
from deepinfer.output_processor import OutputProcessor
from deepinfer.outputs import EmbeddingRequestOutput, RequestOutput
from deepinfer.pooling_params import PoolingParams, pooler_defaults
from deepinfer.sampling_params import RequestOutputKind, SamplingParams
from deepinfer.types.lora import LoRARequest
from deepinfer.types.plan import EngineStats
from deepinfer.types.traffic_class import retention_classes

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 10.0
WATCHDOG_INTERVAL_S = 0.5
# The core's heartbeat thread speaks every 0.5 s; this much silence means it is not running.
ENGINE_STALL_S = 5.0
ENGINE_STALL_RESTART_S = 30.0
# One loop iteration (a step) this long is a hang, not work: a CPU step of a large prefill
# chunk takes seconds, a GPU step milliseconds.
ENGINE_STEP_HANG_S = 600.0
CORE_START_TIMEOUT_S = 900.0
RETRY_AFTER_S = 1


class EngineDeadError(RuntimeError):
    """The engine core is gone or stalled; this request cannot be served (HTTP 503)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (its client went away) while someone still waited on it."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (e.g. its grammar did not compile in time)."""


class RequestTimeoutError(RuntimeError):
    """The request ran past the server's deadline (--request-timeout-s; HTTP 408)."""


class ServerBusyError(RuntimeError):
    """The pending-request limit is reached (HTTP 429)."""


@dataclass
class _Tracked:
    stream: OutputStream
    timings: RequestTimings
    child_ids: list[str]
    deadline: float | None
    engine: int                                      # the core it runs on, for its whole life
    stopped: set[str] = field(default_factory=set)   # children ended by a stop sequence upstream


@dataclass
class EngineInfo:
    model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    started: float = field(default_factory=time.time)


@dataclass
class _Engine:
    """One engine core as the client supervises it: data-parallel rank `index`, its process of the
    moment (a new CoreProcess after each restart) and what the front end knows of it."""

    index: int
    num_engines: int
    core: CoreProcess | None = None
    info: EngineInfo | None = None
    dead_reason: str | None = None     # set when it dies or is killed; a new process's Ready clears it
    busy_for_s: float = 0.0            # from its heartbeats: time in its current loop iteration
    last_stats: EngineStats | None = None
    num_restarts: int = 0
    output_task: asyncio.Task | None = None
    restart_task: asyncio.Task | None = None   # while set, the watchdog leaves this core alone

    @property
    def name(self) -> str:
        return "the engine core" if self.num_engines == 1 else f"engine core {self.index}"

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.core is not None and self.core.alive

    @property
    def healthy(self) -> bool:
        """Alive, heard from within ENGINE_STALL_S, and not stuck in one step."""
        return self.alive and self.core.silent_for() < ENGINE_STALL_S and self.busy_for_s < ENGINE_STEP_HANG_S

    @property
    def unhealthy_reason(self) -> str | None:
        if self.healthy:
            return None
        if not self.alive:
            return self.dead_reason or f"{self.name} is not running"
        if self.busy_for_s >= ENGINE_STEP_HANG_S:
            return f"{self.name} has been in one step for {self.busy_for_s:.0f} s"
        return f"{self.name} has sent nothing for {self.core.silent_for():.0f} s"


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, source: ModelSource, *, load_format: str = "auto",
                 max_pending_requests: int = 1024,
                 request_timeout_s: float = 0.0, max_engine_restarts: int = 3, log_requests: bool = False,
                 log_stats: bool = True, metrics_vllm_names: bool = False,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        from deepinfer.models.loader import check_load_format

        self.config = config
        self.load_weights = check_load_format(load_format, source)   # every core it starts (restarts too)
        self.tokenizer = source.tokenizer   # None with skip_tokenizer_init
        self.eos_token_ids = source.eos_token_ids
        self.vocab_size = source.hf_config["vocab_size"]
        self.hf_config = source.hf_config   # what /v1/embeddings checks `dimensions` against
        self.model_id = config.model.served_model_name or source.name
        self.max_pending_requests = max_pending_requests
        self.request_timeout_s = request_timeout_s
        self.max_engine_restarts = max_engine_restarts
        self.log_requests = log_requests
        self.log_stats = log_stats   # the periodic stats line (--disable-log-stats turns it off)
        self.on_fatal = on_fatal
        self.output_processor = OutputProcessor(self.tokenizer)
        self.traffic_classes = retention_classes(config.cache.kv_retention)   # what traffic_class may be
        self.pooler = pooler_defaults(config.model.pooler_config)   # a bad --pooler-config fails here
        num_engines = config.parallel.data_parallel_size
        self.engines = [_Engine(i, num_engines) for i in range(num_engines)]
        self.balancer = DPLoadBalancer(num_engines)
        # Each core's devices, decided now so that too few devices is an error before anything starts.
        self._core_env = [core_device_env(config.parallel, i) for i in range(num_engines)]
        # The core resolves max_model_len the same way; the token histograms' buckets need it now.
        self.metrics = ServerMetrics(self.model_id, resolve_max_model_len(config, source.hf_config),
                                     num_engines=num_engines, engine_healthy=lambda i: self.engines[i].healthy,
                                     vllm_names=metrics_vllm_names)
        self.info: EngineInfo | None = None   # the first core's; max_model_len is every core's
        self._facts: EngineFacts | None = None
        self._requests: dict[str, _Tracked] = {}
        self._parent_of: dict[str, str] = {}
        self._num_pending_seqs = 0   # children in flight: n > 1 counts n
        self._watchdog_task: asyncio.Task | None = None

    # ------------------------------------------------------------------------ lifecycle
    async def start(self, timeout_s: float = CORE_START_TIMEOUT_S) -> EngineInfo:
        """Start every core (they load at the same time) and the watchdog; if one fails, stop all."""
        results = await asyncio.gather(*(self._start_engine(e, timeout_s) for e in self.engines),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for engine in self.engines:
                self._stop_engine(engine)
            raise failed[0]
        if self._watchdog_task is None:
            self._watchdog_task = asyncio.create_task(self._watchdog(), name="engine-watchdog")
        return self.info

    async def _start_engine(self, engine: _Engine, timeout_s: float = CORE_START_TIMEOUT_S) -> None:
        core = CoreProcess(self.config, load_weights=self.load_weights, data_parallel_rank=engine.index,
                           env=self._core_env[engine.index])
        try:
            ready = await core.start(timeout_s)
        except BaseException:
            core.shutdown()
            raise
        engine.core, engine.dead_reason, engine.busy_for_s, engine.last_stats = core, None, 0.0, None
        started = engine.info.started if engine.info else time.time()
        engine.info = EngineInfo(self.model_id, ready.max_model_len, ready.num_kv_blocks, ready.block_size, started)
        if self.info is None:
            self.info = engine.info
            self._facts = EngineFacts(self.model_id, ready.max_model_len, self.eos_token_ids,   # for admission
                                      self.traffic_classes, self.pooler)
        # Also after a restart: counters carry the old core's totals on, process metrics follow the pid.
        self.metrics.engine_started(self.config.cache, ready.num_kv_blocks, ready.pid, engine=engine.index)
        engine.output_task = asyncio.create_task(self._output_loop(engine, core), name=f"engine-outputs-{engine.index}")
        logger.info("%s ready (pid %s): %s, max_model_len=%d, %d KV blocks of %d tokens", engine.name, core.pid,
                    self.model_id, ready.max_model_len, ready.num_kv_blocks, ready.block_size)

    def _stop_engine(self, engine: _Engine) -> None:
        for task in (engine.output_task, engine.restart_task):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        if engine.core is not None:
            engine.core.shutdown()

    async def shutdown(self) -> None:
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
        for engine in self.engines:
            self._stop_engine(engine)
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def healthy(self) -> bool:
        """Every core alive, heard from within ENGINE_STALL_S and not stuck in one step; /health
        says this. With several cores, requests still go to the healthy ones meanwhile."""
        return all(engine.healthy for engine in self.engines)

    @property
    def unhealthy_reason(self) -> str | None:
        reasons = [engine.unhealthy_reason for engine in self.engines if not engine.healthy]
        return "; ".join(reasons) if reasons else None

    @property
    def num_pending(self) -> int:
        return self._num_pending_seqs

    # ------------------------------------------------------------------------- requests
    def new_request_id(self) -> str:
        # Random, so ids (which become response ids) do not reveal traffic volume.
        return secrets.token_hex(12)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                 prompt: str | None = None, priority: int = 0,
                 cache_salt: str | None = None, traffic_class: str | None = None,
                 images: ImageInputs | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request now (so a full queue or a dead engine raises here, before any HTTP
        response starts) and return an iterator of its DELTA RequestOutputs until it finishes.
        `lora_request`: the LoRA adapter it runs under (checked by the caller: lora/registry.py).

        Closing the iterator early (the HTTP client went away, or the caller saw enough)
        aborts the request in the core, which frees its KV blocks."""
        request_id = request_id or self.new_request_id()
        tracked = self.add_request(request_id, prompt_token_ids, params, prompt=prompt, priority=priority,
                                   cache_salt=cache_salt, traffic_class=traffic_class, images=images,
                                   lora_request=lora_request)
        return self._iterate(request_id, tracked)

    async def _iterate(self, request_id: str, tracked: _Tracked) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await tracked.stream.get()
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
                if item.finished:
                    return
        finally:
            if request_id in self._requests:
                self.abort(request_id)

    async def embed(self, prompt_token_ids: list[int], params: PoolingParams, *, request_id: str | None = None,
                    prompt: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    traffic_class: str | None = None, lora_request: LoRARequest | None = None
                    ) -> EmbeddingRequestOutput:
        """Add a pooling (embedding) request now and wait for its one output, the vector. The
        limits, deadlines, aborts and health rules of `generate` hold; cancelling the wait aborts it."""
        request_id = request_id or self.new_request_id()
        message = pooling_request(request_id, prompt_token_ids, params, self._facts, priority=priority,
                                  cache_salt=cache_salt, traffic_class=traffic_class, lora=lora_request)
        index, encoded = self._encode_for_core(request_id, [message])
        child_ids = self.output_processor.add_pooling_request(request_id, prompt, prompt_token_ids)
        tracked = self._register(request_id, index, encoded, child_ids, RequestTimings(len(prompt_token_ids)))
        try:
            out = await tracked.stream.get()   # its one output (one put, nothing to merge)
        finally:   # cancelled, failed or timed out: free it in the core (a no-op once it finished)
            if request_id in self._requests:
                self.abort(request_id)
        if out.error is not None:
            raise RequestFailedError(out.error)
        return out

    def _encode_for_core(self, request_id: str, messages: list[AddRequest]) -> tuple[int, list[bytes]]:
        """The least loaded healthy core for these child requests, and the messages encoded for
        it; raises (busy, dead, a duplicate id) before anything is registered or sent. Encoding
        first means a value msgpack cannot carry fails here and leaves no trace."""
        index = self.balancer.choose(e.index for e in self.engines if e.healthy)
        if index is None:
            raise EngineDeadError(self.unhealthy_reason)
        if self._num_pending_seqs + len(messages) > self.max_pending_requests:
            raise ServerBusyError(f"the server has {self._num_pending_seqs} sequences in flight and this request "
                                  f"adds {len(messages)}; the limit is {self.max_pending_requests} "
                                  "(--max-pending-requests); retry later")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        return index, [self.engines[index].core.encode(m) for m in messages]

    def _register(self, request_id: str, index: int, encoded: list[bytes], child_ids: list[str],
                  timings: RequestTimings) -> _Tracked:
        """Track a request whose children are encoded for core `index`, then send them."""
        deadline = time.monotonic() + self.request_timeout_s if self.request_timeout_s > 0 else None
        tracked = _Tracked(OutputStream(), timings, child_ids, deadline, index)
        # Registered here, released only by _forget: the balancer's counts stay exact.
        self._requests[request_id] = tracked
        self._num_pending_seqs += len(child_ids)
        self.balancer.added(index, len(child_ids))
        for child_id in child_ids:
            self._parent_of[child_id] = request_id
        for raw in encoded:   # every child to the same core: they share the prompt's KV blocks there
            self.engines[index].core.send_encoded(raw)
        return tracked

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    traffic_class: str | None = None, images: ImageInputs | None = None,
                    lora_request: LoRARequest | None = None) -> _Tracked:
        """Register and send a request, to the least loaded healthy core: all of it, or (on any
        error) none of it."""
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        messages = child_requests(request_id, prompt_token_ids, params, self._facts, priority=priority,
                                  cache_salt=cache_salt, traffic_class=traffic_class, images=images,
                                  lora=lora_request)
        index, encoded = self._encode_for_core(request_id, messages)
        max_tokens = messages[0].max_tokens
        child_ids = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params,
                                                      lora_request=lora_request)
        tracked = self._register(request_id, index, encoded, child_ids,
                                 RequestTimings(len(prompt_token_ids), n=len(child_ids), max_tokens=max_tokens))
        if self.log_requests:   # sizes and settings only: prompts and outputs stay out of logs
            logger.info("request %s: %d prompt tokens, n=%d, max_tokens=%d, temperature=%g, top_p=%g, top_k=%d, "
                        "seed=%s, priority=%d, structured=%s, lora=%s, engine core %d", request_id,
                        len(prompt_token_ids), params.n, max_tokens, params.temperature, params.top_p, params.top_k,
                        params.seed, priority, params.structured_outputs.kind if params.structured_outputs else None,
                        lora_request.lora_name if lora_request is not None else None, index)
        return tracked

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Forget a request and free its KV blocks in the core (no-op when already done).
        A consumer still waiting gets `error` (default: RequestAbortedError)."""
        tracked = self._forget(request_id)
        core_ids = self.output_processor.abort(request_id)
        if tracked is not None:
            self.metrics.record_finished(tracked.timings, "abort", engine=tracked.engine)
            tracked.stream.fail(error or RequestAbortedError(f"request {request_id} was aborted"))
        if core_ids:
            # Its core; were it unknown, every core (an unknown id is nothing to a core).
            for engine in [self.engines[tracked.engine]] if tracked is not None else self.engines:
                if engine.alive:
                    engine.core.send(Abort(core_ids))

    def profile(self, start: bool) -> None:
        """Start or stop the torch profiler on every live engine core (engine/profiling.py)."""
        for engine in self.engines:
            if engine.alive:
                engine.core.send(Profile(start))

    def abort_child(self, request_id: str, index: int) -> None:
        """Stop one of a request's n sequences (the protocol layer saw a stop sequence in it).

        The core answers with an "abort" output for that child, which finishes it here."""
        tracked = self._requests.get(request_id)
        if tracked is None or not 0 <= index < len(tracked.child_ids):
            return
        engine = self.engines[tracked.engine]
        if engine.alive:
            tracked.stopped.add(tracked.child_ids[index])
            engine.core.send(Abort([tracked.child_ids[index]]))

    def _forget(self, request_id: str) -> _Tracked | None:
        tracked = self._requests.pop(request_id, None)
        if tracked is not None:
            self._num_pending_seqs -= len(tracked.child_ids)
            self.balancer.finished(tracked.engine, len(tracked.child_ids))
            for child_id in tracked.child_ids:
                self._parent_of.pop(child_id, None)
        return tracked

    # -------------------------------------------------------------------------- outputs
    async def _output_loop(self, engine: _Engine, core: CoreProcess) -> None:
        try:
            while True:
                messages = [await core.recv()]
                messages += core.recv_ready()   # whatever else queued meanwhile: one batch
                outputs = []
                for message in messages:
                    if isinstance(message, Failed):
                        self._die(engine, f"{engine.name} crashed:\n{message.error}")
                        return
                    if isinstance(message, Heartbeat):
                        engine.busy_for_s = message.busy_for_s
                    elif isinstance(message, StepOutputs):
                        engine.busy_for_s = 0.0
                        self._record_step(engine, message)
                        outputs += message.outputs
                if outputs:
                    self._dispatch(engine, outputs)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave requests waiting forever
            logger.exception("engine output loop failed")
            self._die(engine, f"the output loop of {engine.name} failed: {e!r}")

    def _record_step(self, engine: _Engine, message: StepOutputs) -> None:
        engine.last_stats = message.stats
        self.metrics.record_engine_stats(message.stats, message.iteration_tokens, engine=engine.index)
        for child_id, times in message.finished_times.items():
            tracked = self._requests.get(self._parent_of.get(child_id, ""))
            if tracked is not None:
                tracked.timings.on_core_finished(tracked.child_ids.index(child_id), times)

    def _dispatch(self, engine: _Engine, outputs) -> None:
        processed = self.output_processor.process(outputs)
        if processed.abort_ids:   # stop strings found here: the core must stop those children
            engine.core.send(Abort(processed.abort_ids))   # all from `outputs`, so all on this core
        now = time.monotonic()
        for out in processed.request_outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:
                continue
            if isinstance(out, EmbeddingRequestOutput):   # one output, no tokens: it is done
                tracked.stream.put(out)
                tracked.timings.finished = now
                self.metrics.record_finished(tracked.timings, "stop" if out.error is None else "abort",
                                             engine=engine.index)
                self._forget(out.request_id)
                continue
            timings = tracked.timings
            new_per_sequence = [len(c.token_ids) for c in out.outputs]   # ordered by index, all n
            num_new = sum(new_per_sequence)
            first = timings.first_token is None and num_new > 0
            interval = timings.on_tokens(new_per_sequence, now)
            if first:
                self.metrics.record_first_output(timings, engine=engine.index)
            if num_new:
                self.metrics.record_tokens(num_new, interval, engine=engine.index)
            tracked.stream.put(out)
            if out.finished:
                timings.finished = now
                # The core says "abort" for children stopped upstream (a stop sequence): a stop.
                reasons = {"stop" if child in tracked.stopped else c.finish_reason
                           for child, c in zip(tracked.child_ids, out.outputs)}
                reason = "abort" if "abort" in reasons else "length" if "length" in reasons else "stop"
                self.metrics.record_finished(timings, reason, engine=engine.index)
                self._forget(out.request_id)

    # ---------------------------------------------------------------------------- health
    async def _watchdog(self) -> None:
        last_log = time.monotonic()
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            now = time.monotonic()
            self._expire_deadlines(now)
            for engine in self.engines:
                self._supervise(engine)
            if self.log_stats and now - last_log >= STATS_LOG_INTERVAL_S:
                last_log = now
                self._log_stats()

    def _supervise(self, engine: _Engine) -> None:
        if engine.restart_task is not None:   # being started again (or the server is giving up)
            return
        core = engine.core
        if engine.dead_reason is None:
            if not core.alive:
                self._die(engine, f"{engine.name} process exited unexpectedly (exit code {core.exitcode})")
            elif core.silent_for() >= ENGINE_STALL_RESTART_S or engine.busy_for_s >= ENGINE_STEP_HANG_S:
                reason = engine.unhealthy_reason
                core.kill()
                self._die(engine, f"{engine.name} stopped answering ({reason}); killed it")
            elif not engine.healthy and self._on_engine(engine):
                # Stalled: nobody should wait on it; new requests go elsewhere (or are refused).
                self._fail_engine(engine, EngineDeadError(engine.unhealthy_reason))
        if engine.dead_reason is not None:
            # A task of its own: a core loads for seconds to minutes, and meanwhile the watchdog
            # keeps supervising the other cores and expiring deadlines.
            engine.restart_task = asyncio.create_task(self._restart(engine), name=f"engine-restart-{engine.index}")

    def _expire_deadlines(self, now: float) -> None:
        late = [rid for rid, t in self._requests.items() if t.deadline is not None and now >= t.deadline]
        for request_id in late:
            self.abort(request_id, RequestTimeoutError(
                f"the request ran longer than the server's limit of {self.request_timeout_s:g} s "
                "(--request-timeout-s)"))

    async def _restart(self, engine: _Engine) -> None:
        try:
            if engine.output_task is not None:
                engine.output_task.cancel()
            engine.core.shutdown()
            if engine.num_restarts >= self.max_engine_restarts:
                reason = (f"{engine.name} failed and was restarted {engine.num_restarts} times "
                          f"(--max-engine-restarts); giving up: {engine.dead_reason}")
                logger.critical("%s", reason)
                if self.on_fatal is not None:
                    self.on_fatal(reason)
                await asyncio.Event().wait()   # the server is exiting; keep reporting unhealthy
            engine.num_restarts += 1
            logger.warning("restarting %s (restart %d of at most %d)", engine.name, engine.num_restarts,
                           self.max_engine_restarts)
            try:
                await self._start_engine(engine)
            except Exception as e:
                logger.error("%s did not start again: %s", engine.name, e)
                engine.dead_reason = f"{engine.name} did not start again: {e}".splitlines()[0]
        finally:
            engine.restart_task = None   # a core still dead is restarted again by the next watchdog pass

    def _log_stats(self) -> None:
        for engine in self.engines:
            s = engine.last_stats
            if s is None or not engine.alive:
                continue
            where = "" if len(self.engines) == 1 else f"Engine {engine.index:03d}: "
            in_flight = self.balancer.unfinished[engine.index]
            level = logging.INFO if s.num_running or s.num_waiting else logging.DEBUG
            logger.log(level, "%sRunning: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, in flight here: %d",
                       where, s.num_running, s.num_waiting, 100 * s.kv_cache_usage, in_flight)
            if s.spec_decode is not None and s.spec_decode.num_drafts:
                logger.log(level, "%sSpeculative decoding: %s", where, s.spec_decode.summary())

    def _on_engine(self, engine: _Engine) -> list[str]:
        return [rid for rid, t in self._requests.items() if t.engine == engine.index]

    def _die(self, engine: _Engine, reason: str) -> None:
        if engine.dead_reason is None:
            logger.error("%s", reason)
            engine.dead_reason = reason.splitlines()[0]
        self._fail_engine(engine, EngineDeadError(engine.dead_reason))

    def _fail_engine(self, engine: _Engine, error: Exception) -> None:
        """Fail every request in flight on `engine` with `error` (and abort them there if it is
        still alive: a stalled core finds the aborts queued when it resumes)."""
        for request_id in self._on_engine(engine):
            self.abort(request_id, error)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._requests):
            self.abort(request_id, error)
