"""The only place deepinfer reads environment variables.

Environment variables are for host matters only (which accelerator, where caches live, how
much to log). Everything that changes what the engine computes is a config field with a CLI
flag instead (see config.py).
"""

from __future__ import annotations

import os
from pathlib import Path

VALID_ACCELERATORS = ("auto", "cuda", "cpu")


def accelerator() -> str:
    """DEEPINFER_ACCELERATOR: auto (CUDA when present) | cuda | cpu."""
    value = os.environ.get("DEEPINFER_ACCELERATOR", "auto").strip().lower()
    if value not in VALID_ACCELERATORS:
        raise ValueError(
            f"DEEPINFER_ACCELERATOR={value!r} is not valid; choose one of {', '.join(VALID_ACCELERATORS)}"
        )
    return value


def cache_dir() -> Path:
    """DEEPINFER_CACHE_DIR: where assembled model files and converted tokenizers are kept."""
    return Path(os.environ.get("DEEPINFER_CACHE_DIR", Path.home() / ".cache" / "deepinfer"))


def log_level() -> str:
    """DEEPINFER_LOGGING_LEVEL: DEBUG | INFO | WARNING | ERROR (default INFO)."""
    return os.environ.get("DEEPINFER_LOGGING_LEVEL", "INFO").upper()


def pdl() -> bool:
    """DEEPINFER_PDL: 1 (default) | 0. Programmatic dependent launch of the fast path's Triton
    kernels on Hopper and later (deepinfer/layers/fused/__init__.py); 0 launches them plainly.
    Results are the same either way: only the overlap of one kernel's start with the previous
    kernel's end changes."""
    value = os.environ.get("DEEPINFER_PDL", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"DEEPINFER_PDL={value!r} is not valid; choose 0 or 1")
    return value == "1"


def cuda_visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of device ids (None: unset, every device is visible). Read
    to give each data-parallel engine core its own devices (frontend/dp_balancer.py)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


def child_log_level() -> str:
    """DEEPINFER_LOG_LEVEL (default WARNING): the log level of the helper processes the engine
    starts (tensor-parallel ranks, the KV store's I/O process)."""
    return os.environ.get("DEEPINFER_LOG_LEVEL", "WARNING").upper()


def triton_interpreter() -> bool:
    """TRITON_INTERPRET=1: Triton runs its kernels in its CPU interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def omp_threads_chosen() -> bool:
    """Whether the user chose torch's host thread count with OMP_NUM_THREADS."""
    return "OMP_NUM_THREADS" in os.environ


def openai_api_key() -> str | None:
    """OPENAI_API_KEY: the key `deepinfer bench serve` sends when --api-key is not given."""
    return os.environ.get("OPENAI_API_KEY")


def child_env(extra: dict[str, str] | None = None, python_path: list[str] | None = None) -> dict[str, str]:
    """This process's environment for a child process, with `extra` set and `python_path` put
    before the PYTHONPATH it had (so the child imports the same deepinfer)."""
    env = dict(os.environ)
    env.update(extra or {})
    if python_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*python_path, os.environ.get("PYTHONPATH")) if p)
    return env


def set_env(values: dict[str, str]) -> None:
    """Set variables in this process before anything reads them (a data-parallel core's devices)."""
    os.environ.update(values)


def pop(name: str) -> str:
    """Read and remove a variable a parent handed this process once (a rank's token)."""
    return os.environ.pop(name)


def torch_profiler_dir() -> str | None:
    """DEEPINFER_TORCH_PROFILER_DIR (or vLLM's VLLM_TORCH_PROFILER_DIR): where the server's
    /start_profile and /stop_profile write the engine core's torch profiler traces; unset, the
    routes do not exist (engine/profiling.py)."""
    return os.environ.get("DEEPINFER_TORCH_PROFILER_DIR") or os.environ.get("VLLM_TORCH_PROFILER_DIR") or None


def allow_runtime_lora_updating() -> bool:
    """DEEPINFER_ALLOW_RUNTIME_LORA_UPDATING (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): true / 1
    adds the server's /v1/load_lora_adapter and /v1/unload_lora_adapter routes (any client with the
    API key may then make the server read a directory it names); unset or false, they do not exist."""
    for name in ("DEEPINFER_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes"):
            return True
    return False
