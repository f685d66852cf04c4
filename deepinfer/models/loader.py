"""Where model files come from: one entry point, `load_model_source`, for every kind of source.

    source = load_model_source("default")          # the embedded SmolLM2-135M-Instruct GGUF
    source = load_model_source("/models/x.gguf")   # any GGUF deepinfer can map
    source = load_model_source("/models/Llama-3")  # an HF directory (config.json + safetensors)
    source = load_model_source("org/name")         # an HF hub id, downloaded when online

Whatever the source, the result looks like an HF checkpoint: `hf_config` is config.json-shaped,
`iter_weights()` yields HF parameter names with tensors in HF layout and value convention, and
`tokenizer` is a deepinfer Tokenizer. Model code therefore never knows where its weights came from.

`load_model_source(model, skip_tokenizer_init=True)` (vLLM's option) reads no tokenizer at all, so
a checkpoint without tokenizer files loads; `tokenizer` is None then and the EOS ids come from
generation_config.json / config.json (`eos_token_ids`). vLLM's other loading options, as
ModelConfig has them (`model_source(config)`): `tokenizer` (the tokenizer and chat template from
another directory, GGUF file or hub id), `revision` (of a hub model), `hf_overrides` (merged into
config.json); `check_load_format` says what `load_format` means for a source.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.models.errors import ModelLoadError  # raised here; callers import it from here too

if TYPE_CHECKING:
    import torch

    from deepinfer.config import ModelConfig
    from deepinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# load_format: auto (whatever the model is), safetensors or gguf (the model must be of that kind),
# dummy (random weights of the model's shape). vLLM's other formats name files deepinfer does not
# read; they are accepted with a warning, and the model's safetensors or GGUF load as with auto.
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
FOREIGN_LOAD_FORMATS = ("pt", "npcache", "tensorizer", "sharded_state", "bitsandbytes", "mistral",
                        "runai_streamer", "fastsafetensors")


@dataclass
class ModelSource:
    name: str  # short model id: the prefix-cache key's model id and the served model name
    path: str  # resolved local path (a directory or a .gguf file)
    hf_config: dict
    tokenizer: Tokenizer | None   # None: loaded with skip_tokenizer_init
    generation_config: dict = field(default_factory=dict)
    revision: str | None = None   # the hub revision asked for
    hf_overrides: dict = field(default_factory=dict)   # merged into hf_config (hf_overrides)
    # Produces the weights lazily, so that building a ModelSource (config + tokenizer) is cheap
    # and the dequantized weights exist only while the model copies them in.
    _weights: Callable[[bool], Iterator[tuple[str, torch.Tensor]]] | None = field(default=None, repr=False)

    @property
    def revision_key(self) -> str | None:
        """What roots the prefix-cache keys beside the name (types/block_hashes.hash_root): the
        revision, and the config overrides, which change the KV of the same tokens (blocks of
        an instance with other overrides must never be found in a shared store)."""
        if not self.hf_overrides:
            return self.revision
        return f"{self.revision or ''}+hf_overrides={json.dumps(self.hf_overrides, sort_keys=True)}"

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end generation: the tokenizer's, or without one, the `eos_token_id` of
        generation_config.json, else of config.json (each an int or a list)."""
        if self.tokenizer is not None:
            return self.tokenizer.eos_token_ids
        ids = self.generation_config.get("eos_token_id")
        if ids is None:
            ids = self.hf_config.get("eos_token_id")
        if ids is None:
            return frozenset()
        return frozenset(int(i) for i in (ids if isinstance(ids, list) else [ids]))

    def iter_weights(self, keep_int4: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, tensor) pairs; GGUF tensors come dequantized to float32.

        keep_int4: GGUF Q4_0/Q4_1 matrices come as `Int4Blocks` (see layers/linear.py).
        """
        if self._weights is None:
            raise ModelLoadError(f"model source {self.path} has no weights")
        return self._weights(keep_int4)


def model_source(config: ModelConfig) -> ModelSource:
    """The source `config` describes: its model, tokenizer, revision and hf_overrides."""
    return load_model_source(config.model, skip_tokenizer_init=config.skip_tokenizer_init,
                             tokenizer=config.tokenizer, revision=config.revision,
                             hf_overrides=config.json_field("hf_overrides"))


def load_model_source(model: str | None, *, skip_tokenizer_init: bool = False, tokenizer: str | None = None,
                      revision: str | None = None, hf_overrides: dict | None = None) -> ModelSource:
    """Resolve `model` (None/"default", a .gguf path, an HF directory, or a hub id) and load it.

    skip_tokenizer_init: read no tokenizer (ModelSource.tokenizer is None).
    tokenizer: take the tokenizer (and its chat template) from this model instead.
    revision: the hub revision to download (a local model has none: ModelConfig warns).
    hf_overrides: merged into the model's config (a nested dict replaces the key's value whole).
    """
    # With a tokenizer of its own the model's is not read (its files need not exist).
    source = _load(model, skip_tokenizer_init or tokenizer is not None, revision)
    if hf_overrides:
        source.hf_config = {**source.hf_config, **hf_overrides}
        source.hf_overrides = dict(hf_overrides)
        logger.info("config.json overridden (hf_overrides): %s", sorted(hf_overrides))
    if tokenizer is not None and not skip_tokenizer_init:
        source.tokenizer = _load_tokenizer(tokenizer, source)
    return source


def _load(model: str | None, skip_tokenizer_init: bool, revision: str | None) -> ModelSource:
    if model is None or model == "default":
        from deepinfer.models.bundled import SMOLLM2_NAME, default_model_path

        return _load_gguf(default_model_path(), SMOLLM2_NAME, skip_tokenizer_init)

    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a .gguf file or an HF directory")
        return _load_gguf(path, None, skip_tokenizer_init)
    if os.path.isdir(path):
        return _load_hf_dir(path, os.path.basename(os.path.normpath(path)), skip_tokenizer_init)
    if _looks_like_path(model):
        raise ModelLoadError(f"model file or directory not found: {path}")
    source = _load_hf_dir(_download_from_hub(model, revision), model, skip_tokenizer_init)
    source.revision = revision
    return source


def _load_tokenizer(name: str, source: ModelSource) -> Tokenizer:
    """The tokenizer (and chat template) of `name`: a .gguf file, a directory with a
    tokenizer.json (no config.json needed), or a hub id; the EOS ids the model's."""
    from deepinfer.models.hf_loader import _load_tokenizer as load_from_directory

    path = os.path.expanduser(name)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"tokenizer {path} is a file but not a .gguf; pass a .gguf file or a directory "
                                 "with a tokenizer.json")
        tokenizer = _load_gguf(path, None, False).tokenizer
    else:
        if not os.path.isdir(path):
            if _looks_like_path(name):
                raise ModelLoadError(f"tokenizer file or directory not found: {path}")
            path = _download_from_hub(name)
        tokenizer = load_from_directory(path, source.hf_config, source.generation_config)
    logger.info("tokenizer from %s (not the model's own)", path)
    return tokenizer


def check_load_format(load_format: str, source: ModelSource) -> bool:
    """Whether weights load (False: dummy); refuses a format the source is not of."""
    if load_format in FOREIGN_LOAD_FORMATS:
        logger.warning("load_format=%r: deepinfer reads safetensors and GGUF files only; %s loads as with 'auto'",
                       load_format, source.path)
    elif load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS + FOREIGN_LOAD_FORMATS)}, "
                         f"got {load_format!r}")
    is_gguf = source.path.endswith(".gguf")
    if (load_format == "gguf") != is_gguf and load_format in ("gguf", "safetensors"):
        raise ModelLoadError(f"load_format={load_format!r}, but {source.path} is "
                             f"{'a GGUF file' if is_gguf else 'a safetensors checkpoint'}")
    return load_format != "dummy"


def _looks_like_path(model: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else that does not exist is a missing path."""
    return model.endswith(".gguf") or model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def _load_gguf(path: str, name: str | None, skip_tokenizer_init: bool) -> ModelSource:
    from deepinfer.models.gguf_loader import GGUFFile, file_cache_key, gguf_config, iter_gguf_weights
    from deepinfer.tokenizer import Tokenizer

    # The header (metadata + tokenizer vocab) is parsed once and shared by config, tokenizer
    # and weights; the tensor bytes stay memory-mapped until iter_weights reads them.
    gguf = GGUFFile(path)
    config = gguf_config(gguf)
    generation_config = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    tokenizer = None if skip_tokenizer_init else Tokenizer.from_gguf_metadata(
        gguf.metadata, generation_config=generation_config, cache_key=file_cache_key(path)
    )
    if name is None:
        name = os.path.basename(path)[: -len(".gguf")]
    return ModelSource(
        name=name,
        path=os.path.abspath(path),
        hf_config=config,
        tokenizer=tokenizer,
        generation_config=generation_config,
        _weights=lambda keep_int4: iter_gguf_weights(gguf, config, keep_int4),
    )


def _load_hf_dir(path: str, name: str, skip_tokenizer_init: bool) -> ModelSource:
    from deepinfer.models.hf_loader import load_hf_directory

    config, generation_config, tokenizer, weights = load_hf_directory(path, load_tokenizer=not skip_tokenizer_init)
    return ModelSource(
        name=name,
        path=os.path.abspath(path),
        hf_config=config,
        tokenizer=tokenizer,
        generation_config=generation_config,
        _weights=lambda keep_int4: weights(),
    )


# Only what a safetensors checkpoint needs: no .bin/.pt/.h5 duplicates, no original/ folders.
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]


def _download_from_hub(repo_id: str, revision: str | None = None) -> str:
    """Snapshot an HF hub repo at `revision` (or reuse the local hub cache) and return its directory."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelLoadError(
            f"{repo_id!r} is not a local file or directory, and loading it from the HF hub needs "
            "huggingface_hub: pip install huggingface_hub"
        ) from e
    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, revision=revision)
    except Exception as online_error:  # offline, unknown repo, gated repo, ...
        try:  # a copy already in the local hub cache still works offline
            return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, revision=revision, local_files_only=True)
        except Exception:
            raise ModelLoadError(
                f"{repo_id!r} is not a local file or directory, and downloading it from the HF hub "
                f"failed ({type(online_error).__name__}: {online_error}); check the id, the network, "
                "or pass a local path"
            ) from online_error
