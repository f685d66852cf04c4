"""The executor of one worker in the engine core's own process (vLLM's UniProcExecutor).

Each call is a plain method call on the one ModelRunner; `runner` is public for tests and
benchmarks that look inside the worker (its model, its KV tensors). The engine core never
reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer.config import EngineConfig
from deepinfer.executor.abstract import Executor
from deepinfer.platforms import current_platform
from deepinfer.types.plan import ForwardStep, GrammarOutput, LaunchedStep, RunnerResult, SchedulerPlan
from deepinfer.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from deepinfer.kv_cache.events import KVEventSink
    from deepinfer.kv_cache.store.persistent_worker import StoreWorkerStats
    from deepinfer.models.loader import ModelSource
    from deepinfer.types.drafter import Draft, DraftRequest


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, *, load_weights: bool = True) -> None:
        self.runner: ModelRunner | None = ModelRunner(config, source.hf_config, current_platform(),
                                                      source if load_weights else None)
        self.kv_cache_config = self.runner.kv_cache_config

    def execute_model(self, plan: SchedulerPlan) -> ForwardStep:
        return self.runner.forward(plan)

    def sample_tokens(self, forward: ForwardStep, grammar: GrammarOutput | None) -> LaunchedStep:
        return self.runner.sample(forward, grammar)

    def collect(self, launched: LaunchedStep) -> RunnerResult:
        return self.runner.collect(launched)

    def profile_verify_step(self, num_seqs: int, num_query: int) -> float:
        return self.runner.profile_verify_step(num_seqs, num_query)

    def supports_mtp(self) -> bool:
        return self.runner.supports_mtp()

    def propose_mtp(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        return self.runner.propose_mtp(requests)

    def kv_connector_stats(self) -> StoreWorkerStats | None:
        stats = getattr(getattr(self.runner, "kv_connector", None), "stats", None)
        return stats() if stats is not None else None

    def encoder_counters(self) -> dict[str, float] | None:
        images = getattr(self.runner, "images", None)
        return images.counters() if images is not None else None

    def attach_kv_events(self, sink: KVEventSink) -> None:
        attach = getattr(getattr(self.runner, "kv_connector", None), "attach_kv_events", None)
        if attach is not None:
            attach(sink)

    def shutdown(self) -> None:
        connector = getattr(self.runner, "kv_connector", None)
        if connector is not None:   # a persistent store flushes its queued writes (bounded)
            connector.close()
        self.runner = None   # the model and KV tensors go with the last reference
