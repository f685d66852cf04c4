"""The engine core: executor + KV manager + scheduler, stepped by one of two loops.

The core never touches the model runner: it talks to an executor (executor/), which runs each
plan on the worker(s) and reports the KV layout at start. It builds the parts (the executor, the
KV manager, the speculative decoder, the KV tier's scheduler side, the scheduler, the grammar
manager) and hands them to its loop, which it picks once:
    engine/plain_loop.py       schedule -> execute -> apply, one step at a time
    engine/overlapped_loop.py  plan and queue step N+1 while the device still runs step N
(`async_scheduling`; unset, the platform's choice: overlapped where a device runs ahead of the
host). A step's structured-output masks are filled by a worker thread while the forward runs;
the loop waits for the fill right before queuing the sampling and hands the filled masks over
as a value (GrammarOutput). The plan itself is final when `schedule()` returns.

The offline `LLM` drives it in-process; the server runs it in its own process.
"""

from __future__ import annotations

import dataclasses
import logging

from deepinfer.config import EngineConfig, fit_block_size, resolve_max_model_len
from deepinfer.engine.kv_tier import KVTierLink
from deepinfer.engine.overlapped_loop import OverlappedLoop
from deepinfer.engine.plain_loop import PlainLoop
from deepinfer.engine.scheduler import Scheduler
from deepinfer.executor import make_executor
from deepinfer.kv_cache.events import KVEventSink, open_kv_events
from deepinfer.kv_cache.manager import KVCacheManager, replay_config
from deepinfer.kv_cache.store.factory import make_kv_connector_scheduler
from deepinfer.kv_cache.tier_metrics import tier_metrics
from deepinfer.models.loader import ModelSource
from deepinfer.models.registry import model_class, takes_images
from deepinfer.multimodal.encoder_cache import image_scheduler
from deepinfer.platforms import Platform, current_platform
from deepinfer.sample.structured import StructuredOutputManager
from deepinfer.spec_decode import build_speculative_decoder
from deepinfer.spec_decode.overlap import LoopChooser
from deepinfer.types.block_hashes import hash_root
from deepinfer.types.plan import EngineCoreOutput, EngineStats
from deepinfer.types.request import Request
from deepinfer.types.tier_stats import KVConnectorStats, KVTierMetrics

logger = logging.getLogger(__name__)


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
        self.executor = make_executor(config, source, load_weights=load_weights)
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
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len, self.spec, self.kv_tier,
                                   images=image_scheduler(config, hf_config) if takes_images(hf_config) else None,
                                   max_loras=config.lora.max_loras if config.lora.enable_lora else None)
        self.kv_events = open_kv_events(config.cache, kv.block_size, data_parallel_rank)   # None: no endpoint
        if self.kv_events is not None:
            self._attach_kv_events(self.kv_events)
        # Grammars are compiled against the tokenizer's vocabulary: without one (skip_tokenizer_init)
        # there is no structured output, and add_request refuses constrained requests.
        self.structured = None if source.tokenizer is None else StructuredOutputManager(
            source.tokenizer, hf_config["vocab_size"], f"{source.path}:{source.tokenizer.vocab_size}",
            compile_timeout_s=config.scheduler.structured_outputs_compile_timeout_s,
            unpack_on_host=self.platform.grammar_masks_as_host_bias)
        self.loop = self._make_loop(resolve_async_scheduling(config, self.platform))
        self.platform.settle_host_threads()

    def _make_loop(self, overlapped: bool) -> PlainLoop | OverlappedLoop:
        parts = (self.scheduler, self.executor, self.structured, self.spec, self.kv_tier)
        if not overlapped:
            return PlainLoop(*parts)
        chooses = self.spec is not None and self.spec.method.chooses_loop
        return OverlappedLoop(*parts, loop_chooser=LoopChooser() if chooses else None)

    @property
    def async_scheduling(self) -> bool:
        """Whether the overlapped loop runs (else the plain one)."""
        return isinstance(self.loop, OverlappedLoop)

    @async_scheduling.setter
    def async_scheduling(self, overlapped: bool) -> None:
        """Switch loops while nothing is in flight (benchmarks compare both on one engine)."""
        if overlapped == self.async_scheduling:
            return
        if self.loop.has_pending():
            raise RuntimeError("the engine loop can only be switched while no step is in flight")
        self.loop = self._make_loop(overlapped)

    @property
    def num_kv_blocks(self) -> int:
        return self.executor.kv_cache_config.num_blocks

    def add_request(self, request: Request) -> None:
        constraint = request.sampling_params.structured_outputs
        if constraint is not None and self.structured is None:
            raise ValueError("structured outputs need a tokenizer, so they cannot be used with "
                             "skip_tokenizer_init=True")
        if request.lora is not None and not self.config.lora.enable_lora:
            raise ValueError(f"the request names LoRA adapter {request.lora.lora_name!r}, but this engine "
                             "serves none: start it with enable_lora=True (--enable-lora)")
        if constraint is not None and request.grammar is None:
            request.grammar = self.structured.grammar_for(constraint)   # compiles from now on
        request.hash_root = self.kv_manager.hash_root   # this engine's model, dtype, block size, rank
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.loop.has_pending()

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
        outputs = self.loop.step()
        if self.kv_events is not None:
            self.kv_events.flush()   # one batch per step
        return outputs

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
                           kv_tier_metrics=self._kv_tier_metrics(tier_stats), encoder=self._encoder_counters())

    def _encoder_counters(self) -> dict[str, float] | None:
        images = self.scheduler.images
        if images is None:
            return None
        return {"cache_hits": images.num_cache_hits, **(self.executor.encoder_counters() or {})}

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


def resolve_async_scheduling(config: EngineConfig, platform: Platform) -> bool:
    """None (the default): overlapped where the host has a device to run ahead of (CUDA); plain
    where the forward runs on the host and nothing overlaps (the CPU). With speculative
    decoding, overlapped steps are those without drafts (engine/overlapped_loop.py)."""
    wanted = config.scheduler.async_scheduling
    if wanted is None:
        return platform.overlaps_host_and_device
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
