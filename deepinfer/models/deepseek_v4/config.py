"""The DeepSeek-V4 settings our layers read, parsed once from an HF config dict.

Two spellings exist: transformers' (`layer_types`, `compress_rates`, `mlp_layer_types`, nested
`rope_parameters` with "main" / "compress") and the checkpoint's own config.json (`compress_ratios`
with one 0 / 4 / 128 per layer, MTP layers included, `num_hash_layers`, `qk_rope_head_dim`,
`rope_scaling`). `V4Config.from_hf` reads either, so a loader can hand it the file as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TO_TYPE = {0: SLIDING, 1: SLIDING, 4: CSA, 128: HCA}


@dataclass
class V4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int                 # the single shared K=V head, also each query head
    rope_dim: int                 # trailing channels of a head that get rope (qk_rope_head_dim)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: list[str]        # attention kind per main layer
    mlp_types: list[str]          # "hash_moe" or "moe" per main layer
    compress_rates: dict[str, int]
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    rms_norm_eps: float
    rope: dict[str, dict[str, Any]]   # "main" and "compress" rope settings
    num_mtp_layers: int = 0
    mtp_layer_types: list[str] = field(default_factory=list)
    tie_word_embeddings: bool = False

    def rate(self, layer_type: str) -> int:
        """Tokens per compressed row for a layer kind (0 for sliding-only)."""
        return self.compress_rates.get(layer_type, 0) if layer_type != SLIDING else 0

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> V4Config:
        n = cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim", 512)
        rates = dict(cfg.get("compress_rates") or {CSA: cfg.get("compress_rate_csa", 4),
                                                   HCA: cfg.get("compress_rate_hca", 128)})
        ratios = cfg.get("compress_ratios")
        layer_types = cfg.get("layer_types")
        if not layer_types and ratios is not None:
            layer_types = [_RATIO_TO_TYPE[r] for r in ratios[:n]]
        if not layer_types:    # transformers' default schedule: 2 HCA, then CSA / HCA alternating
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mtp = cfg.get("num_nextn_predict_layers", 0) or 0
        # The checkpoint's compress_ratios also covers the MTP layers (the released ones are 0).
        mtp_types = [_RATIO_TO_TYPE[r] for r in ratios[n:n + mtp]] if ratios and len(ratios) >= n + mtp else []
        mtp_types += [SLIDING] * (mtp - len(mtp_types))
        mlp_types = cfg.get("mlp_layer_types")
        if not mlp_types:
            n_hash = cfg.get("num_hash_layers", 3)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        if cfg.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * cfg["partial_rotary_factor"])
        else:
            rope_dim = cfg.get("qk_rope_head_dim", head_dim // 8)
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=n,
            num_heads=cfg["num_attention_heads"], head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=cfg["q_lora_rank"], o_groups=cfg["o_groups"], o_lora_rank=cfg["o_lora_rank"],
            sliding_window=cfg["sliding_window"], layer_types=list(layer_types[:n]), mlp_types=list(mlp_types[:n]),
            compress_rates=rates, index_heads=cfg["index_n_heads"], index_head_dim=cfg["index_head_dim"],
            index_topk=cfg["index_topk"], hc_mult=cfg["hc_mult"], hc_sinkhorn_iters=cfg["hc_sinkhorn_iters"],
            hc_eps=cfg["hc_eps"], num_experts=cfg["n_routed_experts"], experts_per_token=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
            scoring_func=cfg.get("scoring_func", "sqrtsoftplus"), swiglu_limit=cfg.get("swiglu_limit", 0.0) or 0.0,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope=_rope_settings(cfg),
            num_mtp_layers=mtp, mtp_layer_types=mtp_types,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def _rope_settings(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{"main": ..., "compress": ...}. Sliding-only layers use plain rope at `rope_theta`; layers
    with a compressor (their attention, compressor and indexer alike) use `compress_rope_theta`
    with the config's YaRN scaling, whose cos/sin are not multiplied by YaRN's mscale."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return {"main": dict(params["main"]), "compress": dict(params["compress"])}
    scaling = {k: v for k, v in (cfg.get("rope_scaling") or params).items() if k not in ("main", "compress")}
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
    compress = {**scaling, "rope_theta": cfg.get("compress_rope_theta", 160000.0)}
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}
