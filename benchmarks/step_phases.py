"""Where an engine's steps spend host time, by phase (for benchmarks that ask with --phases).

Wraps an EngineCore's scheduler and executor calls with timers, in place, on that one engine:

    schedule   Scheduler.schedule (drafting included)
    update     Scheduler.update (apply a collected step's tokens)
    forward    Executor.execute_model (build the inputs, queue the forward or replay the graph)
    sample     Executor.sample_tokens (queue sampling / verification)
    collect    Executor.collect (waits for the device: on CUDA mostly the device's time)
    core       the rest of EngineCore.step (the loop chooser, grammar fills, bookkeeping)
    caller     between one step() returning and the next starting (the LLM loop's output
               processing, detokenization)

`take()` gives milliseconds per step of each, since the last take. On CUDA, a step's host time
that the device does not hide is roughly everything but `collect`.
"""

from __future__ import annotations

import time
from collections import defaultdict

PHASES = {("scheduler", "schedule"): "schedule", ("scheduler", "update"): "update",
          ("executor", "execute_model"): "forward", ("executor", "sample_tokens"): "sample",
          ("executor", "collect"): "collect"}


class StepPhases:
    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._last_return: float | None = None
        for (owner, name), phase in PHASES.items():
            self._wrap(getattr(engine, owner), name, phase)
        step = engine.step

        def timed_step():
            start = time.perf_counter()
            if self._last_return is not None:
                self.seconds["caller"] += start - self._last_return
            inner = sum(self.seconds[p] for p in PHASES.values())
            try:
                return step()
            finally:
                self._last_return = end = time.perf_counter()
                self.seconds["core"] += (end - start) - (sum(self.seconds[p] for p in PHASES.values()) - inner)
                self.steps += 1

        engine.step = timed_step

    def _wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        """Milliseconds per step of each phase since the last take (then starts afresh); the
        caller's time after the last step of a run is not counted."""
        steps = max(self.steps, 1)
        out = {"steps": self.steps, **{p: round(1e3 * s / steps, 4) for p, s in sorted(self.seconds.items())}}
        self.seconds.clear()
        self.steps = 0
        self._last_return = None
        return out
