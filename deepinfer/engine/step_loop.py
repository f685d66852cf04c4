"""What the engine core's two loops share: the parts they drive and the steps of a step.

The core (engine/core.py) runs one of two loops, side by side in their own files:
    plain_loop.py       schedule -> execute -> apply, one step at a time
    overlapped_loop.py  plan and queue step N+1 while the device still runs step N
Both give identical tokens. Each loop's `step()` returns the outputs of the steps it applied;
this base holds what both do the same way: fill a step's structured-output masks while its
forward runs, launch a step that must be collected before the next is planned (every plain step;
a speculative one under overlapping), collect a step and let its observers time it, and decide
what an engine with nothing to compute does.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from deepinfer.engine.kv_tier import KVTierLink
from deepinfer.engine.scheduler import Scheduler
from deepinfer.executor import Executor
from deepinfer.sample.structured import StructuredOutputManager
from deepinfer.sample.structured.bitmask import BitmaskFill
from deepinfer.spec_decode import SpeculativeDecoder
from deepinfer.spec_decode.overlap import LoopChooser
from deepinfer.types.plan import EngineCoreOutput, LaunchedStep, RunnerResult, SchedulerPlan

# How long an idle engine sleeps on a compiling grammar before looking at its inputs again.
GRAMMAR_IDLE_WAIT_S = 0.005
# How long an engine with nothing to compute but KV transfers in flight sleeps between polls.
KV_POLL_IDLE_WAIT_S = 0.0005


@dataclass
class InFlight:
    """A step launched on the device and not collected yet."""

    plan: SchedulerPlan
    launched: LaunchedStep
    queued_at: float                  # when its forward was queued (perf_counter)
    # It verifies drafts, so it emits a number of tokens a request that the next plan must know:
    # the next step collects it before planning. (A speculative step whose requests had no
    # drafts is a plain step: the next one may plan ahead of it.)
    verifies: bool = False
    speculative: bool = False         # launched as a speculative (synchronous) step
    expected_tokens: float | None = None   # what the adaptive policy expected it to emit


class StepLoop(ABC):
    # Picks, per step, between a speculative step and an overlapped one (overlapped_loop.py);
    # None: every step speculates when speculation is on.
    loop_chooser: LoopChooser | None = None

    def __init__(self, scheduler: Scheduler, executor: Executor, structured: StructuredOutputManager | None,
                 spec: SpeculativeDecoder | None, kv_tier: KVTierLink | None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.structured = structured   # None: no tokenizer, so no structured output
        self.spec = spec
        self.kv_tier = kv_tier

    @abstractmethod
    def step(self) -> list[EngineCoreOutput]:
        """Run the loop once: the outputs of every step applied meanwhile."""

    def has_pending(self) -> bool:
        """Whether a launched step awaits collection (the overlapped loop's)."""
        return False

    # ------------------------------------------------------------------ shared steps
    def _has_executor_work(self, plan: SchedulerPlan, device_idle: bool) -> bool:
        """Whether the plan goes to the executor. A plan without chunks still does when the runner
        has something to do: drop finished requests, drop encoder outputs the scheduler freed
        (with the encoder cache off, a step's images leave with the next plan, and under async
        scheduling the plan after a request's last chunk is often empty: max_tokens=1, prefill
        instances, pooling; the scheduler has already forgotten them, so a plan not sent would
        leave them in the runner for good), or start KV connector transfers (loads of requests
        parked in WAITING_FOR_KV, saves); its result then reports the transfers finished so far.
        With transfers in flight and nothing to compute on an idle device, sleep a little rather
        than spin on the copies."""
        connector_work = plan.kv_connector_metadata is not None and not plan.kv_connector_metadata.is_empty
        frees_images = plan.images is not None and bool(plan.images.free)
        polling = self.kv_tier is not None and self.kv_tier.busy   # transfers in flight: ask the worker
        if plan.is_empty and polling and not connector_work and device_idle:
            time.sleep(KV_POLL_IDLE_WAIT_S)
        return (not plan.is_empty or bool(plan.finished_request_ids) or connector_work or frees_images
                or polling)

    def _wait_while_idle(self, failed: list[EngineCoreOutput]) -> None:
        """Nothing to compute and nothing in flight."""
        if self.scheduler.num_waiting and not self.scheduler.num_running:
            # Capacity is checked at start-up, so this means a bug, not a busy engine: fail
            # loudly rather than spin.
            raise RuntimeError("the scheduler cannot admit the next waiting request into an idle engine")
        if not failed and self.scheduler.waiting_for_grammar:
            # Nothing to compute but compiles in flight: sleep on one instead of spinning.
            self.scheduler.waiting_for_grammar[0].grammar.wait(GRAMMAR_IDLE_WAIT_S)

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

    def _launch_synchronous(self, plan: SchedulerPlan) -> InFlight:
        """Queue a step whose tokens the next plan needs: forward, then sampling with the masks
        that filled while the forward ran."""
        fill = self._start_bitmask(plan)   # fills in a worker while the forward runs
        forward_start = time.perf_counter()
        forward = self.executor.execute_model(plan)
        launched = self.executor.sample_tokens(forward, None if fill is None else fill.result())
        return InFlight(plan, launched, forward_start, speculative=True,
                        verifies=plan.verify_chain > 1 or any(c.spec_token_ids for c in plan.chunks))

    def _finish(self, step: InFlight, drained: bool = False) -> list[EngineCoreOutput]:
        """Collect a launched step (waits for it), let the step's observers time it, apply it.
        drained: collected before the next step was planned (overlapped_loop.py)."""
        result = self.executor.collect(step.launched)
        self._observe(step, result, drained)
        if self.kv_tier is not None:   # the store's load-or-recompute policy times prefill steps
            self.kv_tier.observe_step(step.plan, step.queued_at)
        return self.scheduler.update(step.plan, result)

    def _observe_step_cost(self, step: InFlight, result: RunnerResult) -> None:
        """The adaptive policy's step-cost model learns the step's own time. A verify chain ran
        its steps back to back: each is one step of the plan's shape."""
        if self.spec is not None:
            self.spec.observe_step(step.plan, (time.perf_counter() - step.queued_at) / result.num_verify_steps)

    @abstractmethod
    def _observe(self, step: InFlight, result: RunnerResult, drained: bool) -> None:
        """Time a collected step, before its result is applied."""
