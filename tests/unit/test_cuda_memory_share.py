"""Two engines sharing one GPU, each at its own gpu_memory_utilization (two `deepinfer serve`
replicas on one card, as vLLM's flag allows): the second engine's KV budget does not count the
first engine's memory as its own, so both get about the same KV pool, and together they stay
within the sum of their fractions. GPU only (skipped without CUDA).

Each engine runs in its own process (torch's memory counters are per process); the first holds
its memory while the second starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("sharing a GPU needs a CUDA device", allow_module_level=True)

ENGINE = """
import sys, time, torch
from deepinfer import LLM
llm = LLM(sys.argv[1], gpu_memory_utilization=float(sys.argv[2]), enforce_eager=True, max_model_len=512)
print("blocks", llm.engine.executor.runner.num_blocks, flush=True)
if sys.argv[3] == "hold":
    time.sleep(600)
"""
FRACTION = 0.3


def engine(model: str, mode: str) -> subprocess.Popen:
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cuda"}
    return subprocess.Popen([sys.executable, "-c", ENGINE, model, str(FRACTION), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def blocks_of(process: subprocess.Popen) -> int:
    for line in process.stdout:
        if line.startswith("blocks "):
            return int(line.split()[1])
    raise AssertionError(f"the engine exited with {process.wait()} before sizing its KV pool")


def test_two_engines_share_a_gpu(tiny_llama):
    free_before, total = torch.cuda.mem_get_info()
    first = engine(tiny_llama, "hold")
    try:
        first_blocks = blocks_of(first)
        time.sleep(1)
        second = engine(tiny_llama, "exit")
        second_blocks = blocks_of(second)
        second.wait(60)
        free_both, _ = torch.cuda.mem_get_info()
    finally:
        first.kill()
        first.wait()
    assert second_blocks > 0.9 * first_blocks, (first_blocks, second_blocks)
    # The first engine alone holds about its fraction (within what CUDA's context takes).
    assert free_before - free_both < (FRACTION + 0.05) * total
