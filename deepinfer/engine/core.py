"""The engine core: executor + KV manager + scheduler, stepped in a loop.

The core never touches the model runner: it talks to an executor (executor/), which runs each
plan on the worker(s) and reports the KV layout at start. A step's structured-output masks
are filled by a worker thread (`_start_bitmask`, a BitmaskFill) while the forward runs; the
core waits for the fill right before queuing the sampling and hands the filled masks over as
a value (GrammarOutput). The plan itself is final when `schedule()` returns.

Plain loop (`async_scheduling=False`):

    step():  plan = scheduler.schedule()
             fill = <start filling the structured-output masks in a worker>
             forward = executor.execute_model(plan)     # the masks fill while the forward runs
             result = executor.collect(executor.sample_tokens(forward, fill.result()))
             return scheduler.update(plan, result)

Overlapped loop (`async_scheduling=True`, the default on CUDA): the host plans and queues the
forward of step N+1 while the device still runs step N, applies N's result while N+1's forward
runs, and only then queues N+1's sampling, so grammar masks and penalties see N's token:

    step():  plan = scheduler.schedule()                # N's sampled tokens count as known
             forward = executor.execute_model(plan)     # queued behind N; inputs from N's device tokens
             outputs = scheduler.update(*in_flight)     # waits for N only; matchers advance
             fill = <fill the masks for N+1>
             in_flight = (plan, executor.sample_tokens(forward, fill.result()))

With grammar rows in N+1, the last line would wait for the fill: the sampling is queued by the
next step() instead, right after it schedules N+2, so the masks fill while the caller turns
`outputs` into text and the scheduler plans (the device is still busy with N+1's forward then).
Without grammar rows it is queued at once.

Both loops give identical tokens. The overlapped one finds a stop one step late: a request
that stopped on N's token has its N+1 chunk computed and that result ignored.

Speculative decoding: a step that verifies drafts is planned after collecting the step in
flight (which drafts, and where they start, depend on its tokens); with overlapped scheduling
it is itself left in flight, so the caller's work on this step()'s outputs overlaps it, and the
next step() collects it before planning (greedy verdicts are taken at collect,
worker/draft_verification.py). With `verify_chain`, such a plan may run several verify steps back
to back on the device (worker/verify_chain.py); the core sees one step that emitted more tokens.
With overlapped scheduling on and adaptive verification, each step first chooses between that
and a plain overlapped step without drafts, by which delivered more tokens a second at this
batch size (spec_decode/overlap.py); fixed verification, MTP drafts, or async_scheduling=False
speculate at every step.

The offline `LLM` drives it in-process; the server runs it in its own process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from deepinfer.config import EngineConfig, fit_block_size, resolve_max_model_len
from deepinfer.engine.kv_tier import KVTierLink
from deepinfer.engine.scheduler import Scheduler
from deepinfer.executor import Executor
from deepinfer.kv_cache.events import KVEventSink, open_kv_events
from deepinfer.kv_cache.manager import KVCacheManager, replay_config
from deepinfer.kv_cache.store.factory import make_kv_connector_scheduler
from deepinfer.kv_cache.tier_metrics import tier_metrics
from deepinfer.models.loader import ModelSource
from deepinfer.models.registry import model_class
from deepinfer.platforms import current_platform
from deepinfer.sample.structured import StructuredOutputManager
from deepinfer.sample.structured.bitmask import BitmaskFill
from deepinfer.spec_decode import build_speculative_decoder
from deepinfer.spec_decode.overlap import LoopChooser
from deepinfer.types.block_hashes import hash_root
from deepinfer.types.plan import EngineCoreOutput, EngineStats, ForwardStep, LaunchedStep, SchedulerPlan
from deepinfer.types.request import Request
from deepinfer.types.tier_stats import KVConnectorStats, KVTierMetrics

logger = logging.getLogger(__name__)


# How long an idle engine sleeps on a compiling grammar before looking at its inputs again.
GRAMMAR_IDLE_WAIT_S = 0.005
# How long an engine with nothing to compute but KV transfers in flight sleeps between polls.
KV_POLL_IDLE_WAIT_S = 0.0005


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource, *, load_weights: bool = True,
                 offline: bool = True, data_parallel_rank: int = 0) -> None:
        """`offline`: the `LLM` class (True) or the server (False); they differ in the batch
        limits the platform picks when the user sets none (Platform.batch_limits).
        `data_parallel_rank`: this core's index among the server's data-parallel cores (its KV
        events carry it and go out on its own endpoint)."""
        self.platform = current_platform()
        # Everything below reads the filled-in limits.
        config = dataclasses.replace(config, scheduler=config.scheduler.with_batch_limits(
            self.platform.batch_limits(offline)))
        hf_config = source.hf_config
        cls = model_class(hf_config)
        config = fit_block_size(config, cls.block_size_multiple(hf_config))
        # A model may refuse a parallel split (a head count tensor_parallel_size does not divide):
        # checked here, so the error is raised once, before any rank starts.
        check_parallel = getattr(cls, "check_parallel", None)
        if check_parallel is not None:
            check_parallel(hf_config, config.parallel)
        self.config = config
        self.max_model_len = resolve_max_model_len(config, hf_config)
        self.executor = Executor.from_config(config, source, load_weights=load_weights)
        kv = self.executor.kv_cache_config
        pool_blocks = kv.pool_blocks or [kv.num_blocks] * (max(g.pool_id for g in kv.groups) + 1)
        for pool, needed in blocks_for_longest_request(kv.groups, self.max_model_len, config).items():
            if pool_blocks[pool] - 1 < needed:
                raise ValueError(
                    f"the KV cache has {pool_blocks[pool] - 1} blocks in pool {pool}, but one request of "
                    f"max_model_len={self.max_model_len} tokens needs {needed} there, across its "
                    f"{sum(g.pool_id == pool for g in kv.groups)} layer groups; raise the KV budget "
                    "(cpu_kv_cache_bytes / gpu_memory_utilization / num_kv_blocks) or lower max_model_len")
        self.kv_manager = KVCacheManager(
            kv.groups, pool_blocks, kv.block_size, config.cache.enable_prefix_caching,
            replay=replay_config(config.cache, kv.groups), swa_retention_s=config.cache.swa_retention_s,
            hash_root=hash_root(source.name, getattr(source, "revision_key", None), kv.block_size,
                                config.cache.kv_cache_dtype, tp_rank=0))
        self.spec = None
        if config.speculative is not None:
            # Built before the scheduler: the step-cost profile runs forwards on an empty KV pool.
            self.spec = build_speculative_decoder(config, self.executor, source, self.max_model_len,
                                                  load_weights=load_weights)
        connector = make_kv_connector_scheduler(config, kv.groups, kv.block_size)
        self.kv_tier = None if connector is None else KVTierLink(connector, self.kv_manager, config.cache.kv_role,
                                                                 config.cache.kv_store_load_policy)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len, self.spec, self.kv_tier)
        self.kv_events = open_kv_events(config.cache, kv.block_size, data_parallel_rank)   # None: no endpoint
        if self.kv_events is not None:
            self._attach_kv_events(self.kv_events)
        # Grammars are compiled against the tokenizer's vocabulary: without one (skip_tokenizer_init)
        # there is no structured output, and add_request refuses constrained requests.
        self.structured = None if source.tokenizer is None else StructuredOutputManager(
            source.tokenizer, hf_config["vocab_size"], f"{source.path}:{source.tokenizer.vocab_size}",
            compile_timeout_s=config.scheduler.structured_outputs_compile_timeout_s,
            unpack_on_host=self.platform.name == "cpu")
        self.async_scheduling = resolve_async_scheduling(config, self.platform.name)
        # Speculative steps run synchronously; the chooser decides, per step, whether to take one
        # or an overlapped step without drafts (None: every step speculates, if speculation is on).
        # MTP drafts read what the target's last forward kept per request, and have not been
        # run behind overlapped steps: an MTP engine speculates at every step.
        self.loop_chooser = (LoopChooser() if self.spec is not None and self.async_scheduling
                             and config.speculative.verification == "adaptive"
                             and config.speculative.method != "mtp" else None)
        self.platform.settle_host_threads()
        # The step launched and not collected yet (overlapped scheduling).
        self._in_flight: _InFlight | None = None
        # Overlapped loop, a step with grammar rows: its forward is queued, its sampling waits for
        # the bitmask fill and is queued by the next step(), after that step's schedule.
        self._deferred_sample: tuple[SchedulerPlan, ForwardStep, BitmaskFill | None, float] | None = None

    @property
    def num_kv_blocks(self) -> int:
        return self.executor.kv_cache_config.num_blocks

    def add_request(self, request: Request) -> None:
        constraint = request.sampling_params.structured_outputs
        if constraint is not None and self.structured is None:
            raise ValueError("structured outputs need a tokenizer, so they cannot be used with "
                             "skip_tokenizer_init=True")
        if constraint is not None and request.grammar is None:
            request.grammar = self.structured.grammar_for(constraint)   # compiles from now on
        request.hash_root = self.kv_manager.hash_root   # this engine's model, dtype, block size, rank
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or self._deferred_sample is not None

    def _attach_kv_events(self, sink: KVEventSink) -> None:
        """Device pools report drops and resets, the scheduler what it publishes, the store tier
        (both sides) what it writes and removes."""
        for pool in self.kv_manager.pools:
            pool.events = sink
        self.scheduler.kv_events = sink
        if self.kv_tier is not None and hasattr(self.kv_tier.connector, "attach_kv_events"):
            self.kv_tier.connector.attach_kv_events(sink)
        self.executor.attach_kv_events(sink)

    def step(self) -> list[EngineCoreOutput]:
        outputs = self._step()
        if self.kv_events is not None:
            self.kv_events.flush()   # one batch per step
        return outputs

    def _speculates(self) -> bool:
        """Whether this step verifies drafts (synchronously) rather than run without them."""
        if self.spec is None:
            return False
        if self.loop_chooser is None:
            return True
        return self.loop_chooser.choose(self.scheduler.num_running)

    def _step(self) -> list[EngineCoreOutput]:
        failed = self.scheduler.poll_grammars()
        speculate = self._speculates()
        if self.async_scheduling and (speculate or (self._in_flight is not None and self._in_flight.verifies)):
            # Drafts follow the tokens of the step in flight, and a verify step emits a number of
            # tokens a request the plan must know: collect it before planning.
            self._launch_deferred_sample()
            if self._in_flight is not None:
                # An overlapped step collected with no step queued behind it: its interval lacks
                # the planning a steady one holds, so the loop chooser leaves it out.
                failed += self._apply_in_flight(drained=True)
        plan = self.scheduler.schedule(speculate=speculate)
        # A sampling deferred by the last step goes first on the device: its masks had the
        # caller's output processing and this schedule to fill in.
        self._launch_deferred_sample()
        # A plan without chunks still goes to the executor when the runner has something to do:
        # drop finished requests, or start KV connector transfers (loads of requests parked in
        # WAITING_FOR_KV, saves); its result then reports the transfers finished so far.
        connector_work = plan.kv_connector_metadata is not None and not plan.kv_connector_metadata.is_empty
        polling = self.kv_tier is not None and self.kv_tier.busy   # transfers in flight: ask the worker
        if plan.is_empty and polling and not connector_work and self._in_flight is None:
            time.sleep(KV_POLL_IDLE_WAIT_S)   # nothing to compute: do not spin on the copies
        if plan.is_empty and not plan.finished_request_ids and not connector_work and not polling:
            was_in_flight = self._in_flight is not None
            if was_in_flight:
                failed += self._apply_in_flight()
            if self.loop_chooser is not None:
                self.loop_chooser.idle()   # an idle stretch is no step's cost (after the last step's observe)
            if was_in_flight:
                return failed
            if self.scheduler.num_waiting and not self.scheduler.num_running:
                # Capacity is checked at start-up, so this means a bug, not a busy engine: fail
                # loudly rather than spin.
                raise RuntimeError("the scheduler cannot admit the next waiting request into an idle engine")
            if not failed and self.scheduler.waiting_for_grammar:
                # Nothing to compute but compiles in flight: sleep on one instead of spinning.
                self.scheduler.waiting_for_grammar[0].grammar.wait(GRAMMAR_IDLE_WAIT_S)
            return failed
        outputs = failed
        if not self.async_scheduling or speculate:
            fill = self._start_bitmask(plan)   # fills in a worker while the forward runs
            forward_start = time.perf_counter()
            forward = self.executor.execute_model(plan)
            step = _InFlight(plan, self.executor.sample_tokens(forward, None if fill is None else fill.result()),
                             forward_start, verifies=plan.verify_chain > 1 or any(c.spec_token_ids for c in plan.chunks),
                             speculative=True)
            if self.loop_chooser is not None and plan.verify_chain == 1 and plan.is_decode_only:
                # (A chain's later steps draft on the device: it is priced by what it emitted.)
                step.expected_tokens = self.spec.expected_emitted(plan.chunks)
            if self.loop_chooser is not None and not step.verifies and plan.is_decode_only:
                # Generating requests and no drafts: said now, so that the next choice already
                # backs off. (A step with prompt chunks had none to find for those.)
                self.loop_chooser.no_drafts(len(plan.chunks))
            if self.async_scheduling:
                # Collected by the next step before it plans: the caller turns this step()'s
                # outputs into text (the server sends them) while the device runs the step.
                self._in_flight = step
                return outputs
            return outputs + self._finish(step)
        queued_at = time.perf_counter()
        forward = self.executor.execute_model(plan)
        if self._in_flight is not None:
            outputs += self._apply_in_flight()   # the device runs `forward` meanwhile
        fill = self._start_bitmask(plan)
        self._deferred_sample = (plan, forward, fill, queued_at)
        if fill is None:
            self._launch_deferred_sample()
        # else: the masks fill while the caller processes `outputs`; the next step() queues the
        # sampling before anything else reaches the device (has_unfinished() stays True till then).
        return outputs

    def _launch_deferred_sample(self) -> None:
        if self._deferred_sample is not None:
            plan, forward, fill, queued_at = self._deferred_sample
            self._deferred_sample = None
            grammar = None if fill is None else fill.result()   # waits for the fill, if still running
            self._in_flight = _InFlight(plan, self.executor.sample_tokens(forward, grammar), queued_at)

    def _start_bitmask(self, plan: SchedulerPlan) -> BitmaskFill | None:
        """Start filling the structured-output masks of the plan's sampled, constrained requests
        (not of those that stopped since it was made: their matcher is done)."""
        if self.structured is None:
            return None
        requests = self.scheduler.requests
        constrained = [c for c in plan.chunks
                       if c.sample and c.request_id in requests and requests[c.request_id].grammar is not None]
        return self.structured.start_bitmask({c.request_id: requests[c.request_id].grammar for c in constrained},
                                             {c.request_id: c.spec_token_ids for c in constrained if c.spec_token_ids})

    def _apply_in_flight(self, drained: bool = False) -> list[EngineCoreOutput]:
        step, self._in_flight = self._in_flight, None
        return self._finish(step, drained)

    def _finish(self, step: _InFlight, drained: bool = False) -> list[EngineCoreOutput]:
        """Collect a launched step (waits for it), let the step's observers time it, apply it.
        drained: collected before the next step was planned (see _step)."""
        plan = step.plan
        result = self.executor.collect(step.launched)
        if self.spec is not None and (step.verifies or not self.async_scheduling):
            # The step's own time, collected before any later step was queued. A verify step left
            # in flight is collected by the next step(): its time then holds the caller's work
            # where that outlasted the device, the step's real period.
            # A verify chain ran its steps back to back: each is one step of the plan's shape.
            self.spec.observe_step(plan, (time.perf_counter() - step.queued_at) / result.num_verify_steps)
        if self.loop_chooser is not None:   # the step is charged the time since the last one's results
            emitted = sum(len(t) for t in result.sampled_token_ids.values())
            if step.expected_tokens is not None:
                emitted = step.expected_tokens   # SpeculativeDecoder.expected_emitted says why
            steady = plan.is_decode_only and not (drained and not step.speculative)
            self.loop_chooser.observe(time.perf_counter(), len(plan.chunks), step.speculative,
                                      emitted if steady else None, drafted=step.verifies or not step.speculative)
        if self.kv_tier is not None:   # the store's load-or-recompute policy times prefill steps
            self.kv_tier.observe_step(plan, step.queued_at)
        return self.scheduler.update(plan, result)

    def check_idle(self) -> None:
        """With no request left, every KV block must be free: log any that is not (a leak)."""
        held = self.kv_manager.blocks_in_use()
        if held:
            logger.error("KV blocks still referenced with no request in the engine (block: refs): %s", held)

    def stats(self) -> EngineStats:
        counters = self.kv_manager.counters
        tier_stats = self.kv_tier.stats() if self.kv_tier is not None else None
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, self.kv_manager.usage(),
                           self.scheduler.num_preemptions, [c.queries for c in counters],
                           [c.hits for c in counters], [c.evictions for c in counters],
                           self.spec.stats.copy() if self.spec is not None else None,
                           prefix_cache_request_queries=self.kv_manager.request_counters.queries,
                           prefix_cache_request_hits=self.kv_manager.request_counters.hits,
                           prefix_cache_replayed=[c.replayed for c in counters],
                           prefix_cache_expirations=[c.expirations for c in counters],
                           kv_group_kinds=[g.spec.kind for g in self.kv_manager.groups],
                           kv_tier=vars(tier_stats) if tier_stats is not None else None,
                           kv_tier_metrics=self._kv_tier_metrics(tier_stats))

    def _kv_tier_metrics(self, stats: KVConnectorStats | None) -> KVTierMetrics | None:
        if stats is None:
            return None
        connector = self.kv_tier.connector
        return tier_metrics(connector.tier_name, stats, connector.load_latency, connector.save_latency,
                            self.executor.kv_connector_stats())

    def shutdown(self) -> None:
        """Release the workers and the grammar threads; the core is not used afterwards."""
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.structured is not None:
            self.structured.shutdown()


@dataclass
class _InFlight:
    """A step launched on the device and not collected yet."""

    plan: SchedulerPlan
    launched: LaunchedStep
    queued_at: float                  # when its forward was queued (perf_counter)
    # It verifies drafts, so it emits a number of tokens a request that the next plan must know:
    # the next step collects it before planning. (A speculative step whose requests had no
    # drafts is a plain step: the next one may plan ahead of it.)
    verifies: bool = False
    speculative: bool = False         # the loop chooser chose speculation for it
    expected_tokens: float | None = None   # what the adaptive policy expected it to emit


def resolve_async_scheduling(config: EngineConfig, platform_name: str) -> bool:
    """None (the default): overlapped on CUDA, where the host has a device to run ahead of; plain
    on the CPU, where the forward runs on the host and nothing overlaps. With speculative
    decoding, overlapped steps are those without drafts (see the module docstring)."""
    wanted = config.scheduler.async_scheduling
    if wanted is None:
        return platform_name == "cuda"
    return wanted


def blocks_for_longest_request(groups, max_model_len: int, config: EngineConfig) -> dict[int, int]:
    """KV blocks one request of max_model_len tokens holds at its peak, per pool.

    A group holds the tokens its kind still needs plus the chunk being computed (a sliding
    window: its window, not the whole length); groups of one pool add up.
    """
    bs = config.cache.block_size
    per_pool: dict[int, int] = {}
    for group in groups:
        kept = group.spec.num_needed_tokens(max_model_len)
        # A window keeps what its next query sees (kept + 1 tokens) plus the chunk computed now.
        tokens = max_model_len if kept >= max_model_len else min(
            max_model_len, kept + 1 + config.scheduler.max_num_batched_tokens)
        # + 1: a window can straddle one more block boundary
        per_pool[group.pool_id] = per_pool.get(group.pool_id, 0) + -(-tokens // bs) + 1
    return per_pool
