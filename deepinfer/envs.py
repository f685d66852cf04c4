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
