"""Engine flags, generated from the config dataclasses so the CLI and `LLM(**kwargs)` never drift.

Every field of ModelConfig, CacheConfig, SchedulerConfig and ParallelConfig is a flag of the same
name (cli/flags.py says how types become flags); `engine_kwargs(args)` turns the parsed flags back
into the keyword arguments of `EngineConfig.from_kwargs` / `LLM(...)`.
"""

from __future__ import annotations

import argparse
from typing import Any

from deepinfer.cli.flags import add_dataclass_flags, dataclass_values
from deepinfer.config import (
    ATTENTION_BACKENDS,
    DTYPE_ALIASES,
    DTYPES,
    EXECUTOR_BACKENDS,
    EXPERT_PARALLEL_DISPATCH,
    KV_CACHE_DTYPES,
    KV_ROLES,
    KV_STORE_LOAD_POLICIES,
    POLICIES,
    QUANTIZATIONS,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

ENGINE_PARTS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig)

# vLLM's short spellings.
_ALIASES = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"], "data_parallel_size": ["-dp"]}
_CHOICES = {
    "dtype": [*DTYPES, *DTYPE_ALIASES],
    "quantization": QUANTIZATIONS,
    "attention_backend": ATTENTION_BACKENDS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "policy": POLICIES,
    "distributed_executor_backend": EXECUTOR_BACKENDS,
    "expert_parallel_dispatch": EXPERT_PARALLEL_DISPATCH,
    "kv_role": KV_ROLES,
    "kv_store_load_policy": KV_STORE_LOAD_POLICIES,
}
# Not generated: `model` gets its own help below, and `served_model_name` is the server's flag
# (`serve --served-model-name a b`, ServerOptions), one flag for both.
_NOT_GENERATED = ("model", "served_model_name")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for klass in ENGINE_PARTS:
        group = parser.add_argument_group(klass.__name__)
        add_dataclass_flags(group, klass, skip=_NOT_GENERATED, aliases=_ALIASES, choices=_CHOICES)
    parser.add_argument("--model", default=None, help="HF directory, .gguf file or hub id (default: the "
                        "embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights of the model's shape (speed measurements)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 5, '
                             '"verification": "adaptive"}\'; method ngram | draft_model (with "model": PATH) | mtp')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for klass in ENGINE_PARTS:
        out.update(dataclass_values(klass, args, skip=("served_model_name",)))
    # serve's --served-model-name may give several names; the engine keys its prefix cache by
    # one model id, the first (the name responses carry).
    names = getattr(args, "served_model_name", None) or ()
    if names:
        out["served_model_name"] = names[0]
    out["load_format"] = args.load_format
    if getattr(args, "speculative_config", None) is not None:
        out["speculative_config"] = args.speculative_config   # JSON text, parsed by EngineConfig
    return out
