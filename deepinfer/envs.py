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


EP_DISPATCH_MODES = ("all_to_all", "all_reduce")


def ep_dispatch() -> str:
    """DEEPINFER_EP_DISPATCH: all_to_all (default) | all_reduce. How an expert-parallel MoE layer
    whose tokens every tensor-parallel rank holds reaches the experts of other ranks
    (models/deepseek_v4/parallel.py): each rank sends its share of the tokens to the experts'
    ranks and gathers the results back, or each rank runs its own experts on every token and one
    all-reduce sums them. Results are the same either way; only the communication changes."""
    value = os.environ.get("DEEPINFER_EP_DISPATCH", "all_to_all").strip().lower()
    if value not in EP_DISPATCH_MODES:
        raise ValueError(f"DEEPINFER_EP_DISPATCH={value!r} is not valid; choose one of "
                         f"{', '.join(EP_DISPATCH_MODES)}")
    return value
