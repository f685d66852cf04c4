"""The plain loop (`async_scheduling=False`, the default on the CPU): one step at a time.

    step():  plan = scheduler.schedule()
             fill = <start filling the structured-output masks in a worker>
             forward = executor.execute_model(plan)     # the masks fill while the forward runs
             result = executor.collect(executor.sample_tokens(forward, fill.result()))
             return scheduler.update(plan, result)

With speculative decoding every step speculates: the scheduler plans drafts for the generating
requests, and the step verifies them. Every step is timed for the adaptive policy's cost model.
"""

from __future__ import annotations

from deepinfer.engine.step_loop import InFlight, StepLoop
from deepinfer.types.plan import EngineCoreOutput, RunnerResult


class PlainLoop(StepLoop):
    def step(self) -> list[EngineCoreOutput]:
        failed = self.scheduler.poll_grammars()
        plan = self.scheduler.schedule(speculate=self.spec is not None)
        if not self._has_executor_work(plan, device_idle=True):
            self._wait_while_idle(failed)
            return failed
        return failed + self._finish(self._launch_synchronous(plan))

    def _observe(self, step: InFlight, result: RunnerResult, drained: bool) -> None:
        # Collected right after its launch: its time is its own.
        self._observe_step_cost(step, result)
