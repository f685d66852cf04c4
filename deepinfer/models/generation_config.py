"""Default sampling parameters from a model's generation_config.json, as vLLM applies them.

Model authors put their recommended sampling settings in generation_config.json (Llama 3:
temperature 0.6, top_p 0.9; Qwen3: temperature 0.6, top_p 0.95, top_k 20). vLLM uses them as
the defaults of every request that does not set the field itself; `--generation-config vllm`
turns that off. The setting (ModelConfig.generation_config):

    auto   the model's own generation_config.json (ModelSource.generation_config; a GGUF file
           carries only its bos/eos ids, so it gives no sampling defaults)
    vllm   none: SamplingParams' own defaults
    DIR    the generation_config.json in that directory

    overrides = default_sampling_overrides(config.model.generation_config, source)
    # e.g. {"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}

A request's own fields win; the overrides fill only the fields it leaves out (LLM uses them
when no SamplingParams is given, the server per field).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from deepinfer.models.hf_loader import read_json

if TYPE_CHECKING:
    from deepinfer.models.loader import ModelSource

# generation_config.json key -> SamplingParams field: the keys vLLM reads, nothing else
# (do_sample, num_beams, ... are not applied). HF's max_new_tokens is vLLM's max_tokens.
SAMPLING_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def read_generation_config(setting: str, source: ModelSource) -> dict[str, Any]:
    """The generation_config dict `setting` names (see the module docstring)."""
    if setting == "auto":
        return dict(source.generation_config)
    if setting == "vllm":
        return {}
    path = os.path.join(os.path.expanduser(setting), "generation_config.json")
    if not os.path.isfile(path):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding a "
                         f"generation_config.json; {path} does not exist")
    return read_json(path)   # its errors (ModelLoadError, a ValueError) name the file


def default_sampling_overrides(setting: str, source: ModelSource, override: dict[str, Any] | None = None
                               ) -> dict[str, Any]:
    """{SamplingParams field: default} from the generation config `setting` names; {} for
    `vllm` or when the file sets none of the sampling keys. null values are skipped.
    `override` (override_generation_config, vLLM's): generation-config keys set over the file's
    (over nothing with `vllm`); a key that is not a sampling key is an error naming it."""
    config = read_generation_config(setting, source)
    unknown = sorted(set(override or {}) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: {', '.join(map(repr, unknown))} not among the keys it "
                         f"sets ({', '.join(SAMPLING_KEYS)})")
    config.update(override or {})
    return {field: config[key] for key, field in SAMPLING_KEYS.items() if config.get(key) is not None}
