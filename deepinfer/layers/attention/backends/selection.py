"""The one place that reads a backend's name: `attention_backend` (config) -> a backend object.

The config field keeps the names users set ("auto" | "reference" | "cpu" | "triton", the
`--attention-backend` flag). The model runner calls `select_backend` once at start; from then
on the object travels with each step's metadata and nothing else looks at a name
(tests/unit/test_attention_backends.py checks the source tree for comparisons with the names).
"auto" is the platform's choice (Platform.default_attention_backend): on CUDA the Triton
backend when Triton imports, on the CPU the CPU backend. The platform names its choice, and
this module turns the name into the class: the backends import the platform, never the other
way round.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from deepinfer.kv_cache.dtypes import FP8_E5M2
from deepinfer.layers.attention.backends.base import AttentionBackend
from deepinfer.layers.attention.backends.cpu import CpuBackend
from deepinfer.layers.attention.backends.reference import ReferenceBackend
from deepinfer.layers.attention.backends.triton import TritonBackend

if TYPE_CHECKING:
    from deepinfer.config import EngineConfig
    from deepinfer.platforms import Platform

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {cls.name: cls for cls in (ReferenceBackend, CpuBackend, TritonBackend)}
AUTO = "auto"


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return BACKENDS[name]


def backend_named(name: str) -> AttentionBackend:
    """A backend by name, unchecked against the platform: for tests and benchmarks that compare
    backends on the same inputs (worker/input_batch.py's build_step_inputs takes a name too)."""
    return backend_class(name)()


def select_backend(config: EngineConfig, platform: Platform, kv_cache_dtype: torch.dtype) -> AttentionBackend:
    """The backend of this engine, from `config.model.attention_backend`; raises ValueError if the
    platform cannot run the one asked for. Logs what was chosen and why."""
    choice = config.model.attention_backend
    if choice == AUTO:
        name, why = platform.default_attention_backend()
        cls, why = backend_class(name), f"auto on {platform.name}: {why}"
        if kv_cache_dtype == FP8_E5M2 and not cls.e5m2_cache:
            logger.warning("kv_cache_dtype=fp8_e5m2: the %s backend's kernels read and write e4m3 only, so "
                           "attention runs on the reference backend (kv_cache_dtype=fp8 keeps the fast path)",
                           cls.name)
            cls, why = backend_class("reference"), "fp8_e5m2 KV cache"
    else:
        cls, why = backend_class(choice), "attention_backend set"
    if kv_cache_dtype == FP8_E5M2 and not cls.e5m2_cache:
        raise ValueError(f"kv_cache_dtype=fp8_e5m2 runs on the reference backend only (attention_backend="
                         f"{cls.name!r} reads and writes fp8 as e4m3); use attention_backend='reference' or "
                         "kv_cache_dtype='fp8'")
    cls.check_supported(platform, kv_cache_dtype)
    backend = cls(platform.device, kv_cache_dtype)
    logger.info("attention backend %s (%s); %s", backend.name, why, backend.describe())
    return backend
