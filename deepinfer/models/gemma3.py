"""Gemma 3 text: interleaved sliding-window and global layers, per-layer rope bases, q/k norm,
(1 + w) RMSNorm, four norms per layer, and an embedding scaled by sqrt(hidden_size)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepinfer.kv_cache.specs import KVCacheSpec
from deepinfer.layers.norm import GemmaRMSNorm
from deepinfer.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from deepinfer.models.base import CausalLM
from deepinfer.models.llama import GatedMLP, LlamaAttention, build_rotaries, head_dim_of, kv_cache_specs_of


def gemma3_layer_types(cfg: dict[str, Any]) -> list[str]:
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    # Known default when a config (or GGUF) leaves it out: every 6th layer is global.
    pattern = cfg.get("sliding_window_pattern", 6)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(cfg["num_hidden_layers"])]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_id: int, rotaries: nn.ModuleDict) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        scale = cfg.get("query_pre_attn_scalar", head_dim_of(cfg)) ** -0.5
        self.self_attn = LlamaAttention(cfg, layer_id, rotaries, norm_cls=GemmaRMSNorm, scale=scale)
        self.mlp = GatedMLP(hidden, cfg["intermediate_size"],
                            cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh"))
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) as in LlamaDecoderLayer. Gemma's post-norms apply to a block's
        output before it joins the residual stream, so they stay plain norms; the pre-norms take
        the add (one kernel each on the fast path)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        if keep_rows is not None:   # only these rows continue (CausalLM.forward's logits_rows)
            hidden, residual = hidden[keep_rows], residual[keep_rows]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.rotary_embs = build_rotaries(cfg)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, self.rotary_embs)
                                    for i in range(cfg["num_hidden_layers"]))
        self.norm = GemmaRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.embed_scale = cfg["hidden_size"] ** 0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_rows: torch.Tensor | None = None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`image_embeds`: (rows, embeddings [len(rows), hidden]) put in place of those rows'
        token embeddings, after the scale (the vision model's, models/gemma3_mm.py)."""
        if image_embeds is not None:
            # An image token's id may lie past the vocabulary (Gemma 3's checkpoints place it at
            # the vocabulary's end); its row is replaced below, so any id in range will do.
            input_ids = input_ids.index_fill(0, image_embeds[0], 0)
        x = self.embed_tokens(input_ids)
        # NOTE: HF rounds the scale to the activation dtype before multiplying; so do we.
        hidden, residual = x * torch.tensor(self.embed_scale, dtype=x.dtype), None
        if image_embeds is not None:
            hidden = hidden.index_copy(0, image_embeds[0], image_embeds[1].to(hidden.dtype))
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, logits_rows if i == last else None)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        cfg = dict(hf_config)
        cfg["layer_types"] = gemma3_layer_types(cfg)
        cfg.setdefault("model_type", "gemma3_text")
        cfg.setdefault("tie_word_embeddings", True)
        if cfg.get("attn_logit_softcapping"):
            raise ValueError("attn_logit_softcapping is not supported (Gemma 3 does not use it)")
        super().__init__(cfg)
        self.model = Gemma3Model(cfg)
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg["hidden_size"], cfg["vocab_size"])
        self.final_logit_softcapping = cfg.get("final_logit_softcapping")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, logits_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def kv_cache_specs(self, dtype: torch.dtype) -> list[KVCacheSpec]:
        return kv_cache_specs_of(self.hf_config, dtype, self.tp.size)
