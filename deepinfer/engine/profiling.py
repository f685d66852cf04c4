"""The engine core under torch's profiler, on request: what `POST /start_profile` and
`POST /stop_profile` do when DEEPINFER_TORCH_PROFILER_DIR (or vLLM's VLLM_TORCH_PROFILER_DIR) names
a directory, as vLLM's server offers them.

Between start and stop every step's host ops and device kernels are recorded; stop writes
  <dir>/engine_core_<pid>_<time>.pt.trace.json.gz   the timeline (Perfetto, chrome://tracing)
  <dir>/engine_core_<pid>_<time>.txt                 the ops and kernels by total time, a table
A start while recording, or a stop while not, is logged and ignored. A recording left running
is stopped at MAX_RECORDING_S, so a forgotten stop does not grow the trace without bound.
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

MAX_RECORDING_S = 600.0
TABLE_ROWS = 60


class CoreProfiler:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._profile: torch.profiler.profile | None = None
        self._started = 0.0

    @property
    def recording(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        if self._profile is not None:
            logger.warning("profiler: already recording; start ignored")
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=False)
        self._profile.start()
        self._started = time.monotonic()
        logger.info("profiler: recording the engine core into %s", self.directory)

    def stop(self) -> str | None:
        """Stop and write the trace and the table; their common path stem, None if not recording."""
        profile, self._profile = self._profile, None
        if profile is None:
            logger.warning("profiler: not recording; stop ignored")
            return None
        profile.stop()
        os.makedirs(self.directory, exist_ok=True)
        stem = os.path.join(self.directory, f"engine_core_{os.getpid()}_{int(time.time())}")
        profile.export_chrome_trace(stem + ".pt.trace.json.gz")
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        with open(stem + ".txt", "w") as f:
            f.write(profile.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS))
        logger.info("profiler: %.1f s recorded, written to %s.{pt.trace.json.gz,txt}",
                    time.monotonic() - self._started, stem)
        return stem

    def check_limit(self) -> None:
        """Called every iteration of the core's loop: stops a recording past MAX_RECORDING_S."""
        if self._profile is not None and time.monotonic() - self._started > MAX_RECORDING_S:
            logger.warning("profiler: recording for over %.0f s; stopped", MAX_RECORDING_S)
            self.stop()
