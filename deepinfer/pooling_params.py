"""What an embedding request asks for: `PoolingParams`, vLLM's name and fields.

A pooling request runs its prompt through the model once (prefill only, nothing sampled) and
returns one vector made of the final hidden states (after the model's last norm) of its tokens:

    LAST   the last token's state (vLLM's default for decoder models served as embedders)
    MEAN   the mean over every prompt token
    CLS    the first token's state

then cut to `dimensions` (matryoshka models only) and L2-normalized unless `normalize` is off,
as vLLM's embedding pooler does (cut first, then normalize).

The engine-wide default comes from `--pooler-config '{"pooling_type": "MEAN", "normalize": false}'`
(vLLM's spelling; its older `--override-pooler-config` is the same flag). This module imports
nothing of deepinfer, so config.py, the core and the front end all read it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

POOLING_TYPES = ("LAST", "MEAN", "CLS")
DEFAULT_POOLING_TYPE = "LAST"
# pooler_config keys vLLM has that change nothing for a decoder model's embeddings here: accepted.
_PASSIVE_POOLER_KEYS = ("enable_chunked_processing", "max_embed_len")


@dataclass(frozen=True)
class PoolingParams:
    """dimensions: keep the first this many values (only for a model whose config.json declares
    matryoshka dimensions, vLLM's rule). normalize: L2-normalize the vector; None: the engine's
    pooler_config (default True). pooling_type: LAST | MEAN | CLS; None: the engine's
    pooler_config (default LAST). Admission fills both Nones before the core sees the request."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    def resolved(self, default: PoolingParams) -> PoolingParams:
        """These params with the engine's defaults (`default`, from pooler_config) filled in."""
        return dataclasses.replace(
            self, normalize=default.normalize if self.normalize is None else self.normalize,
            pooling_type=default.pooling_type if self.pooling_type is None else self.pooling_type)

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read positions a prefix-cache hit would skip: such a request computes
        its whole prompt (the LAST state only needs the last token, which is always computed)."""
        return self.pooling_type != "LAST"


def pooler_defaults(pooler_config: str | dict | None) -> PoolingParams:
    """The engine-wide PoolingParams from pooler_config's JSON object (text or a dict): its
    pooling_type and normalize; unset: LAST, normalized (vLLM's for a decoder model)."""
    config = json.loads(pooler_config) if isinstance(pooler_config, str) else dict(pooler_config or {})
    unknown = set(config) - {"pooling_type", "normalize", *_PASSIVE_POOLER_KEYS}
    if unknown:
        raise ValueError(f"pooler_config: unsupported key(s) {', '.join(sorted(unknown))}; supported: "
                         "pooling_type (LAST | MEAN | CLS), normalize (true | false)")
    kind = config.get("pooling_type") or DEFAULT_POOLING_TYPE
    if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
        raise ValueError(f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}")
    normalize = config.get("normalize", True)
    if normalize is None:
        normalize = True
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    return PoolingParams(normalize=normalize, pooling_type=kind.upper())


def check_dimensions(dimensions: int | None, hf_config: dict) -> str | None:
    """Why `dimensions` cannot be served by this model (None: it can). vLLM's rule: only a
    matryoshka model may shorten its vectors, one whose config.json sets `is_matryoshka` (any
    size up to the hidden size) or `matryoshka_dimensions` (those sizes only)."""
    if dimensions is None:
        return None
    hidden = hf_config.get("hidden_size")
    allowed = hf_config.get("matryoshka_dimensions")
    if not allowed and not hf_config.get("is_matryoshka"):
        return ("this model does not support matryoshka representation, so dimensions cannot be set: changing the "
                "output dimensions would lead to poor results (a model whose config.json declares is_matryoshka "
                "or matryoshka_dimensions can; --hf-overrides sets them)")
    if dimensions < 1:
        return f"dimensions must be at least 1, got {dimensions}"
    if allowed and dimensions not in allowed:
        return f"dimensions must be one of this model's matryoshka dimensions {list(allowed)}, got {dimensions}"
    if hidden is not None and dimensions > hidden:
        return f"dimensions must be at most the model's hidden size ({hidden}), got {dimensions}"
    return None
