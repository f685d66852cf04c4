"""The executor interface: everything the engine core asks of the model's worker(s).

The engine core never touches a model runner: it learns the KV layout from the executor at
start (`kv_cache_config`), hands it each plan, and gets the result back through handles:

    forward = executor.execute_model(plan)               # queue the forward
    launched = executor.sample_tokens(forward, grammar)  # queue the sampling (masks filled by then)
    result = executor.collect(launched)                  # wait for that step, RunnerResult

The overlapped loop (engine/overlapped_loop.py) interleaves these calls of two steps; the plain loop makes
them in a row. Everything that crosses is a plan type (types/plan.py): plain values a later
multi-process executor can send to its ranks. Speculative decoding's runner-side work also goes
through here (`profile_verify_step`, `propose_mtp`), and a draft model gets an executor of its
own from the same factory (executor/factory.py, `make_executor`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer.types.plan import (
    ForwardStep,
    GrammarOutput,
    KVCacheConfig,
    LaunchedStep,
    RunnerResult,
    SchedulerPlan,
)

if TYPE_CHECKING:
    from deepinfer.kv_cache.events import KVEventSink
    from deepinfer.kv_cache.store.persistent_worker import StoreWorkerStats
    from deepinfer.types.drafter import Draft, DraftRequest


logger = logging.getLogger(__name__)


class Executor(ABC):
    # Set by every executor's constructor, once its worker(s) sized the KV pool.
    kv_cache_config: KVCacheConfig

    # ---------------------------------------------------------------------------- steps
    @abstractmethod
    def execute_model(self, plan: SchedulerPlan) -> ForwardStep:
        """Apply the plan's request changes and queue its forward."""

    @abstractmethod
    def sample_tokens(self, forward: ForwardStep, grammar: GrammarOutput | None) -> LaunchedStep:
        """Queue the sampling of a queued forward, with the step's grammar masks if any."""

    @abstractmethod
    def collect(self, launched: LaunchedStep) -> RunnerResult:
        """Wait for a launched step (only that one) and return its result."""

    def execute(self, plan: SchedulerPlan) -> RunnerResult:
        """The three calls in a row, for a plan without grammar rows (a draft model's steps)."""
        return self.collect(self.sample_tokens(self.execute_model(plan), None))

    # ------------------------------------------------------------- speculative decoding
    @abstractmethod
    def profile_verify_step(self, num_seqs: int, num_query: int) -> float:
        """Seconds one verify-shaped step takes (start-up only; see ModelRunner)."""

    @abstractmethod
    def supports_mtp(self) -> bool:
        """Whether the model has a multi-token-prediction head to draft with."""

    @abstractmethod
    def propose_mtp(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        """Drafts from the model's own MTP head."""

    # ---------------------------------------------------------------------------- KV tier
    def kv_connector_stats(self) -> StoreWorkerStats | None:
        """The KV connector worker side's counters, when it keeps any (a persistent store's:
        written, expired, bad entries, write latency), for /metrics; None otherwise."""
        return None

    def encoder_counters(self) -> dict[str, float] | None:
        """The runner's encoder counters (images encoded, encode time, encoder outputs loaded from
        the store, misses, refused entries), for /metrics; None: a text-only model, or an executor
        whose workers do not report them."""
        return None

    def attach_kv_events(self, sink: KVEventSink) -> None:
        """Let the worker side's KV tier report what it stores and removes (KV events)."""

    # -------------------------------------------------------------------------- the end
    @abstractmethod
    def shutdown(self) -> None:
        """Release the worker(s); the executor is not used afterwards."""
