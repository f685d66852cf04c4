"""Reading an HF checkpoint directory: config.json, safetensors (one file or sharded), tokenizer.

Layout expected (what `save_pretrained` and the hub produce):

    config.json                      required
    model.safetensors                or model-00001-of-0000N.safetensors + model.safetensors.index.json
    tokenizer.json                   required unless skip_tokenizer_init (a fast tokenizer; slow-only
                                     repos are not supported)
    tokenizer_config.json            optional: chat_template, special tokens, add_bos_token
    chat_template.jinja              optional: newer repos keep the template here
    generation_config.json           optional: extra eos ids, sampling defaults

Tensors are yielded in the dtype they are stored in (bf16 stays bf16; the model casts), since
upcasting a large checkpoint to float32 on the way in would double its peak memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch

from deepinfer.models.errors import ModelLoadError

SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_json(path: str, required: bool = True) -> dict | None:
    """A JSON file as a dict; errors name the file."""
    if not os.path.isfile(path):
        if required:
            raise ModelLoadError(f"missing file: {path}")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot parse JSON file {path}: {e}") from e
    if not isinstance(value, dict):
        raise ModelLoadError(f"JSON file {path} should hold an object, not {type(value).__name__}")
    return value


def safetensors_files(directory: str) -> list[str]:
    """The weight files of a checkpoint: the shards its index names, or every *.safetensors."""
    index_path = os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path} has no weight_map")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {directory}")
    paths = [os.path.join(directory, f) for f in files]
    for p in paths:
        if not os.path.isfile(p):
            raise ModelLoadError(f"missing weight file: {p} (listed in {index_path})")
    return paths


def check_safetensors(path: str) -> list[str]:
    """Open a safetensors file's header (cheap) so a corrupt file fails at load, naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"corrupt safetensors file {path}: {e}") from e


def iter_safetensors(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for path in paths:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read safetensors file {path}: {e}") from e


def flatten_multimodal_config(config: dict) -> dict:
    """A multimodal config.json nests the language model's fields under text_config: they come up
    to the top, where every model reads its fields, and the top level's own fields (vision_config,
    the image token ids, mm_tokens_per_image) stay beside them, the text model's winning a clash
    (model_type is the text model's). A config without text_config comes back as it is."""
    if "text_config" not in config or "hidden_size" in config:
        return config
    outer = {k: v for k, v in config.items() if k != "text_config"}
    return {**outer, **(config["text_config"] or {}), "architectures": config.get("architectures", [])}


def load_hf_directory(directory: str, load_tokenizer: bool = True):
    """(config, generation_config, Tokenizer or None, weights factory) for an HF checkpoint directory.

    load_tokenizer=False (skip_tokenizer_init) reads no tokenizer file, so none need exist.
    """
    config = flatten_multimodal_config(read_json(os.path.join(directory, "config.json")))
    generation_config = read_json(os.path.join(directory, "generation_config.json"), required=False) or {}
    tokenizer = _load_tokenizer(directory, config, generation_config) if load_tokenizer else None

    if not any(f.endswith(".safetensors") or f == SAFETENSORS_INDEX for f in os.listdir(directory)):
        # A config-only directory serves random-weight runs of a real shape (load_format="dummy");
        # asking it for weights is the error.
        def no_weights() -> Iterator[tuple[str, torch.Tensor]]:
            raise ModelLoadError(f"no *.safetensors weights in {directory}")

        return config, generation_config, tokenizer, no_weights
    paths = safetensors_files(directory)
    for p in paths:
        check_safetensors(p)
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]] = lambda: iter_safetensors(paths)  # noqa: E731
    return config, generation_config, tokenizer, weights


def _load_tokenizer(directory: str, config: dict, generation_config: dict):
    from deepinfer.tokenizer import Tokenizer

    tokenizer_config = read_json(os.path.join(directory, "tokenizer_config.json"), required=False) or {}
    template_path = os.path.join(directory, "chat_template.jinja")
    if "chat_template" not in tokenizer_config and os.path.isfile(template_path):
        with open(template_path, encoding="utf-8") as f:
            tokenizer_config["chat_template"] = f.read()
    return Tokenizer.from_file(
        os.path.join(directory, "tokenizer.json"),
        tokenizer_config,
        generation_config=generation_config or _eos_from_config(config),
    )


def _eos_from_config(config: dict) -> dict:
    """Without a generation_config.json, config.json's eos ids are the ones to stop on."""
    return {"eos_token_id": config["eos_token_id"]} if config.get("eos_token_id") is not None else {}
