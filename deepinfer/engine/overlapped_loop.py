"""The overlapped loop (`async_scheduling=True`, the default on CUDA): the host plans and queues
the forward of step N+1 while the device still runs step N, applies N's result while N+1's
forward runs, and only then queues N+1's sampling, so grammar masks and penalties see N's token:

    step():  plan = scheduler.schedule()                # N's sampled tokens count as known
             forward = executor.execute_model(plan)     # queued behind N; inputs from N's device tokens
             outputs = scheduler.update(*in_flight)     # waits for N only; matchers advance
             fill = <fill the masks for N+1>
             in_flight = (plan, executor.sample_tokens(forward, fill.result()))

With grammar rows in N+1, the last line would wait for the fill: the sampling is queued by the
next step() instead, right after it schedules N+2, so the masks fill while the caller turns
`outputs` into text and the scheduler plans (the device is still busy with N+1's forward then).
Without grammar rows it is queued at once.

It gives the plain loop's tokens, but finds a stop one step late: a request that stopped on N's
token has its N+1 chunk computed and that result ignored.

Speculative decoding: a step that verifies drafts is planned after collecting the step in
flight (which drafts, and where they start, depend on its tokens); it is itself left in flight,
so the caller's work on this step()'s outputs overlaps it, and the next step() collects it
before planning (greedy verdicts are taken at collect, worker/spec/draft_verification.py). With
`verify_chain`, such a plan may run several verify steps back to back on the device
(worker/spec/verify_chain.py); the loop sees one step that emitted more tokens. Where the method
lets it choose (SpeculativeMethod.chooses_loop: adaptive verification, drafts that do not read
the target's last forward), the loop chooser (spec_decode/overlap.py) decides before each step
between that and a plain overlapped step without drafts, by which delivered more tokens a
second at this batch size; otherwise every step speculates.
"""

from __future__ import annotations

import time

from deepinfer.engine.step_loop import InFlight, StepLoop
from deepinfer.sample.structured.bitmask import BitmaskFill
from deepinfer.spec_decode.overlap import LoopChooser
from deepinfer.types.plan import EngineCoreOutput, ForwardStep, RunnerResult, SchedulerPlan


class OverlappedLoop(StepLoop):
    def __init__(self, *parts, loop_chooser: LoopChooser | None = None) -> None:
        super().__init__(*parts)
        # Decides, per step, between a speculative step and an overlapped one without drafts
        # (None: every step speculates, if speculation is on).
        self.loop_chooser = loop_chooser
        # The step launched and not collected yet.
        self._in_flight: InFlight | None = None
        # A step with grammar rows: its forward is queued, its sampling waits for the bitmask
        # fill and is queued by the next step(), after that step's schedule.
        self._deferred_sample: tuple[SchedulerPlan, ForwardStep, BitmaskFill | None, float] | None = None

    def has_pending(self) -> bool:
        return self._in_flight is not None or self._deferred_sample is not None

    def step(self) -> list[EngineCoreOutput]:
        failed = self.scheduler.poll_grammars()
        speculate = self._speculates()
        if speculate or (self._in_flight is not None and self._in_flight.verifies):
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
        if not self._has_executor_work(plan, device_idle=self._in_flight is None):
            return failed + self._idle(failed)
        if speculate:
            self._launch_speculative(plan)
            # Collected by the next step before it plans: the caller turns this step()'s outputs
            # into text (the server sends them) while the device runs the step.
            return failed
        outputs = failed
        queued_at = time.perf_counter()
        forward = self.executor.execute_model(plan)
        if self._in_flight is not None:
            outputs += self._apply_in_flight()   # the device runs `forward` meanwhile
        fill = self._start_bitmask(plan)
        self._deferred_sample = (plan, forward, fill, queued_at)
        if fill is None:
            self._launch_deferred_sample()
        # else: the masks fill while the caller processes `outputs`; the next step() queues the
        # sampling before anything else reaches the device (has_pending() stays True till then).
        return outputs

    def _speculates(self) -> bool:
        """Whether this step verifies drafts (synchronously) rather than run without them."""
        if self.spec is None:
            return False
        if self.loop_chooser is None:
            return True
        return self.loop_chooser.choose(self.scheduler.num_running)

    def _idle(self, failed: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Nothing new to compute: collect what is in flight, else wait a little."""
        was_in_flight = self._in_flight is not None
        outputs = self._apply_in_flight() if was_in_flight else []
        if self.loop_chooser is not None:
            self.loop_chooser.idle()   # an idle stretch is no step's cost (after the last step's observe)
        if not was_in_flight:
            self._wait_while_idle(failed)
        return outputs

    def _launch_speculative(self, plan: SchedulerPlan) -> None:
        step = self._launch_synchronous(plan)
        chooser = self.loop_chooser
        if chooser is not None and plan.verify_chain == 1 and plan.is_decode_only:
            # (A chain's later steps draft on the device: it is priced by what it emitted.)
            step.expected_tokens = self.spec.expected_emitted(plan.chunks)
        if chooser is not None and not step.verifies and plan.is_decode_only:
            # Generating requests and no drafts: said now, so that the next choice already backs
            # off. (A step with prompt chunks had none to find for those.)
            chooser.no_drafts(len(plan.chunks))
        self._in_flight = step

    def _launch_deferred_sample(self) -> None:
        if self._deferred_sample is not None:
            plan, forward, fill, queued_at = self._deferred_sample
            self._deferred_sample = None
            grammar = None if fill is None else fill.result()   # waits for the fill, if still running
            self._in_flight = InFlight(plan, self.executor.sample_tokens(forward, grammar), queued_at)

    def _apply_in_flight(self, drained: bool = False) -> list[EngineCoreOutput]:
        step, self._in_flight = self._in_flight, None
        return self._finish(step, drained)

    def _observe(self, step: InFlight, result: RunnerResult, drained: bool) -> None:
        if step.verifies:
            # A verify step left in flight is collected by the next step(): its time then holds
            # the caller's work where that outlasted the device, the step's real period.
            self._observe_step_cost(step, result)
        if self.loop_chooser is not None:   # the step is charged the time since the last one's results
            emitted = sum(len(t) for t in result.sampled_token_ids.values())
            if step.expected_tokens is not None:
                emitted = step.expected_tokens   # SpeculativeDecoder.expected_emitted says why
            plan = step.plan
            steady = plan.is_decode_only and not (drained and not step.speculative)
            self.loop_chooser.observe(time.perf_counter(), len(plan.chunks), step.speculative,
                                      emitted if steady else None, drafted=step.verifies or not step.speculative)
