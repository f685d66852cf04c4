"""vLLM's engine arguments that deepinfer has no field of its own for, so that a vLLM launch line or
`LLM(...)` call runs unchanged: each is translated into deepinfer's settings where it means
something here, or accepted with a one-line warning saying what happens instead. None of them is
silently dropped when it would change results.

    num_gpu_blocks_override     = num_kv_blocks
    scheduling_policy           = policy
    compilation_config          cudagraph_mode NONE -> enforce_eager; max_cudagraph_capture_size
                                (or max_capture_size, or the largest of cudagraph_capture_sizes)
                                -> max_cudagraph_capture_size; torch.compile levels: warned
    optimization_level (-O)     0: no CUDA graphs (enforce_eager), as vLLM's -O0; 1-3: graphs of
                                decode steps, no torch.compile (warned)
    cuda_graph_sizes            the largest -> max_cudagraph_capture_size (more than one: warned)
    max_seq_len_to_capture      warned: graphs here take any context length
    swap_space                  warned: a preempted request is recomputed, nothing is swapped
    tokenizer_mode              auto / hf: the fast tokenizer; slow, mistral, custom: warned
    disable_custom_all_reduce   what deepinfer always does (NCCL / gloo all-reduce)
    disable_log_stats           the server's (ServerOptions); the offline LLM logs no stats
    override_pooler_config      = pooler_config (vLLM's older name)
    runner, convert, task       pooling / embed / generate accepted: one engine serves generation and
                                embeddings of a decoder model alike (other values are errors)

The CLI flags of these names are cli/args.py's (the "vLLM compatibility" group); LLM(...) and
the CLI build their config with `engine_config(**kwargs)`. (config.py imports nothing of deepinfer,
so the translation lives here, above it.)
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer.config import EngineConfig

logger = logging.getLogger(__name__)

ALIASES = {"num_gpu_blocks_override": "num_kv_blocks", "scheduling_policy": "policy",
           "override_pooler_config": "pooler_config"}
TOKENIZER_MODES = ("auto", "hf", "slow", "mistral", "custom")
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# What each translated name needs (a value of None is "not given", as the CLI's defaults are).
HANDLED = ("compilation_config", "optimization_level", "cuda_graph_sizes", "max_seq_len_to_capture", "swap_space",
           "tokenizer_mode", "disable_custom_all_reduce", "disable_log_stats", "runner", "convert", "task")
# vLLM's --runner / --convert / --task values that mean what this engine does anyway: a decoder model
# generates and embeds (its last-token or mean-pooled final hidden states) from one engine.
RUNNER_VALUES = {"runner": ("auto", "generate", "pooling"), "convert": ("auto", "none", "embed"),
                 "task": ("auto", "generate", "embed", "embedding")}

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's integer flags: `4096`, `4k` (4,000), `4K` (4,096), `25.6k`; decimals only with a
    decimal (lower-case) suffix."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 4k (4,000) or 4K (4,096), got {text!r}")
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a decimal takes a decimal suffix (k, m, g, t), not {suffix!r}")
    return int(number) * _BINARY.get(suffix, 1)


def human_readable_int_or_auto(text: str) -> int | None:
    """human_readable_int, or None for `auto`, `-1` and `None` (the model's own value)."""
    return None if text.strip().lower() in ("auto", "-1", "none") else human_readable_int(text)


def _json(name: str, value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    return value


def _set(out: dict, name: str, value: Any, source: str) -> None:
    """out[name] = value unless the caller set it to something else (that is an error)."""
    if out.get(name) is not None and out[name] != value:
        raise ValueError(f"{source} sets {name}={value!r}, but {name}={out[name]!r} is given too")
    out[name] = value


def engine_config(**kwargs: Any) -> EngineConfig:
    """EngineConfig.from_kwargs, vLLM's names translated first (what LLM and the CLI use)."""
    from deepinfer.config import EngineConfig

    return EngineConfig.from_kwargs(**translate_engine_kwargs(kwargs))


def translate_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with vLLM's names translated into deepinfer's (see the module docstring)."""
    out = dict(kwargs)
    for old, new in ALIASES.items():
        if old in out:
            value = out.pop(old)
            if value is not None:
                if out.get(new) not in (None, value):
                    raise ValueError(f"{old} is vLLM's name for {new}; give one of them (got {value!r} and "
                                     f"{out[new]!r})")
                out[new] = value
    given = {name: out.pop(name) for name in HANDLED if name in out}
    given = {name: value for name, value in given.items() if value is not None}
    if "compilation_config" in given:
        _compilation_config(out, _json("compilation_config", given["compilation_config"]))
    if "optimization_level" in given:
        _optimization_level(out, given["optimization_level"])
    if "cuda_graph_sizes" in given:
        sizes = given["cuda_graph_sizes"]
        sizes = [sizes] if isinstance(sizes, int) else list(sizes)
        if not sizes or not all(isinstance(s, int) and s >= 1 for s in sizes):
            raise ValueError(f"cuda_graph_sizes must be one or more integers >= 1, got {given['cuda_graph_sizes']!r}")
        _set(out, "max_cudagraph_capture_size", max(sizes), "cuda_graph_sizes")
        if len(sizes) > 1:
            logger.warning("cuda_graph_sizes %s: decode graphs are captured at 1, 2, 4, 8 and every multiple of 16 "
                           "up to the largest, %d, not at exactly these sizes", sizes, max(sizes))
    if "max_seq_len_to_capture" in given:
        logger.warning("max_seq_len_to_capture=%s is ignored: deepinfer's CUDA graphs take decode steps at any "
                       "context length", given["max_seq_len_to_capture"])
    if given.get("swap_space"):
        logger.warning("swap_space=%s GiB is ignored: a preempted request is recomputed here, nothing is "
                       "swapped to host memory", given["swap_space"])
    mode = given.get("tokenizer_mode", "auto")
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode must be one of {', '.join(TOKENIZER_MODES)}, got {mode!r}")
    if mode not in ("auto", "hf"):
        logger.warning("tokenizer_mode=%r: deepinfer has one tokenizer, the HF tokenizers library's fast one "
                       "(what 'auto' picks); it is used", mode)
    for name, values in RUNNER_VALUES.items():
        if name in given and given[name] not in values:
            raise ValueError(f"{name}={given[name]!r} is not served here; {name} may be {', '.join(values)} (one "
                             "engine serves both generation and embeddings of a decoder model)")
    return out


def _compilation_config(out: dict, config: Any) -> None:
    if isinstance(config, int) and not isinstance(config, bool):   # vLLM's older -O3 / '3': a level
        config = {"level": config}
    if not isinstance(config, dict):
        raise ValueError(f"compilation_config must be a JSON object (or a level), got {config!r}")
    ignored = []
    for key, value in config.items():
        if key == "cudagraph_mode":
            mode = str(value).upper()
            if mode not in CUDAGRAPH_MODES:
                raise ValueError(f"compilation_config.cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                                 f"got {value!r}")
            if mode == "NONE":
                out["enforce_eager"] = True
            elif mode != "FULL_DECODE_ONLY":
                logger.warning("compilation_config.cudagraph_mode=%s: deepinfer captures whole decode steps only "
                               "(FULL_DECODE_ONLY); prefill and mixed steps run eagerly", mode)
        elif key in ("max_cudagraph_capture_size", "max_capture_size"):
            _set(out, "max_cudagraph_capture_size", value, f"compilation_config.{key}")
        elif key == "cudagraph_capture_sizes":
            if not value or not all(isinstance(s, int) and s >= 1 for s in value):
                raise ValueError(f"compilation_config.cudagraph_capture_sizes must be integers >= 1, got {value!r}")
            _set(out, "max_cudagraph_capture_size", max(value), "compilation_config.cudagraph_capture_sizes")
            if len(value) > 1:
                logger.warning("compilation_config.cudagraph_capture_sizes: decode graphs are captured at 1, 2, 4, 8 "
                               "and every multiple of 16 up to the largest, %d", max(value))
        elif key in ("level", "mode"):
            if value not in (0, "0", "NONE", None):
                logger.warning("compilation_config.%s=%s: deepinfer compiles nothing with torch.compile; its own "
                               "kernels and decode CUDA graphs are what runs", key, value)
        else:
            ignored.append(key)
    if ignored:
        logger.warning("compilation_config keys with no meaning here, ignored: %s", ", ".join(sorted(ignored)))


def _optimization_level(out: dict, level: Any) -> None:
    if isinstance(level, str):
        text = level.strip()
        if text.startswith("{"):   # vLLM's older `-O '{...}'`: a compilation config
            _compilation_config(out, _json("-O", text))
            return
        level = int(text) if text.isdigit() else text
    if isinstance(level, bool) or level not in (0, 1, 2, 3):
        raise ValueError(f"optimization_level (-O) must be 0, 1, 2 or 3, got {level!r}")
    if level == 0:
        out["enforce_eager"] = True   # vLLM's -O0: no compilation, no CUDA graphs
    else:
        logger.warning("-O%d: deepinfer compiles nothing with torch.compile; decode CUDA graphs stay on "
                       "(-O0 or --enforce-eager turns them off)", level)
