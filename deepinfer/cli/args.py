"""Engine flags, generated from the config dataclasses so the CLI and `LLM(**kwargs)` never drift.

Every field of ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, MultiModalConfig and LoRAConfig is a flag
of the same name (cli/flags.py says how types become flags); `engine_kwargs(args)` turns the parsed flags back
into the keyword arguments of `EngineConfig.from_kwargs` / `LLM(...)`.
"""

from __future__ import annotations

import argparse
from typing import Any

from deepinfer.cli.flags import BooleanFlag, add_dataclass_flags, dataclass_values
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
from deepinfer.lora.config import LoRAConfig
from deepinfer.models.loader import FOREIGN_LOAD_FORMATS, LOAD_FORMATS
from deepinfer.multimodal.config import MultiModalConfig
from deepinfer.vllm_compat import RUNNER_VALUES, TOKENIZER_MODES, human_readable_int_or_auto

ENGINE_PARTS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, MultiModalConfig, LoRAConfig)

# vLLM's short spellings, and its names for the same settings.
_ALIASES = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"], "data_parallel_size": ["-dp"],
            "num_kv_blocks": ["--num-gpu-blocks-override"], "policy": ["--scheduling-policy"],
            "pooler_config": ["--override-pooler-config"]}
# vLLM's value forms: 4k (4,000), 4K (4,096); auto / -1: the model's own.
_TYPES = {"max_model_len": human_readable_int_or_auto, "max_num_batched_tokens": human_readable_int_or_auto}
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
        add_dataclass_flags(group, klass, skip=_NOT_GENERATED, aliases=_ALIASES, choices=_CHOICES, types=_TYPES)
    parser.add_argument("--model", default=None, help="HF directory, .gguf file or hub id (default: the "
                        "embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", choices=[*LOAD_FORMATS, *FOREIGN_LOAD_FORMATS], default="auto",
                        metavar="{" + ",".join(LOAD_FORMATS) + ",...}",
                        help="auto | safetensors or gguf (the model must be that kind) | dummy: random weights of "
                             "the model's shape (speed measurements); vLLM's other formats are accepted with a "
                             "warning and load the model's files as auto does")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 5, '
                             '"verification": "adaptive"}\'; method ngram | draft_model (with "model": PATH) | mtp')
    _add_vllm_compat_args(parser)


# vLLM's engine flags without a deepinfer field: vllm_compat.engine_config translates them
# (deepinfer/vllm_compat.py); None is "not given".
VLLM_COMPAT = ("tokenizer_mode", "compilation_config", "optimization_level",
               "cuda_graph_sizes", "max_seq_len_to_capture", "swap_space", "disable_custom_all_reduce", "runner",
               "convert")


def _add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM compatibility", "vLLM's flags without a setting of their own here: "
                                      "translated, or accepted with a one-line warning saying what happens instead")
    a = group.add_argument
    a("--tokenizer-mode", choices=TOKENIZER_MODES, default=None,
      help="auto / hf: the HF tokenizers library's fast tokenizer, the only one here (others: warned, it is used)")
    a("--compilation-config", "-cc", default=None, metavar="JSON",
      help='cudagraph_mode "NONE" = --enforce-eager; max_cudagraph_capture_size (or cudagraph_capture_sizes) = '
           "--max-cudagraph-capture-size; torch.compile settings are warned (nothing is compiled here)")
    a("-O", "--optimization-level", dest="optimization_level", default=None, metavar="LEVEL",
      help="0: no CUDA graphs (--enforce-eager), as vLLM's -O0; 1-3: decode CUDA graphs, no torch.compile "
           "(warned); a JSON object: a --compilation-config")
    a("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
      help="the largest is --max-cudagraph-capture-size (graphs at 1, 2, 4, 8 and multiples of 16 up to it)")
    a("--max-seq-len-to-capture", type=int, default=None, metavar="INT",
      help="ignored, warned: the CUDA graphs here take any context length")
    a("--swap-space", type=float, default=None, metavar="GIB",
      help="ignored, warned: a preempted request is recomputed, nothing is swapped")
    a("--disable-custom-all-reduce", action=BooleanFlag, default=None,
      help="accepted: deepinfer's all-reduce is always NCCL's (gloo's on the CPU)")
    # vLLM's older --task is LLM(task=...) only here: `deepinfer eval` and the benchmarks have a --task of their own.
    for name in ("runner", "convert"):
        values = RUNNER_VALUES[name]
        a(f"--{name}", choices=values, default=None,
          help="accepted: one engine serves a decoder model's generation and embeddings (/v1/embeddings) alike")


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
    for name in VLLM_COMPAT:
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    if getattr(args, "speculative_config", None) is not None:
        out["speculative_config"] = args.speculative_config   # JSON text, parsed by EngineConfig
    return out
