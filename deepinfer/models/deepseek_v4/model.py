"""The V4 model (embedding -> hc_mult streams -> decoder layers -> HyperHead -> norm) and the
causal LM around it, named as the HF layout (model.*, lm_head.weight), plus greedy decoding
through a V4State for the reference's own use and the tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from deepinfer.distributed import current_tp_group
from deepinfer.layers.parallel import VocabParallelEmbedding
from deepinfer.models.deepseek_v4.config import V4Config
from deepinfer.models.deepseek_v4.decoder import V4DecoderLayer
from deepinfer.models.deepseek_v4.hyper import HyperHead
from deepinfer.models.deepseek_v4.mtp import V4MTPLayer
from deepinfer.models.deepseek_v4.norm import V4RMSNorm
from deepinfer.models.deepseek_v4.parallel import check_group
from deepinfer.models.deepseek_v4.rope import V4Rotary
from deepinfer.models.deepseek_v4.state import V4State


def build_rotaries(cfg: V4Config) -> dict[str, V4Rotary]:
    return {kind: V4Rotary(cfg.rope_dim, cfg.rope[kind]) for kind in ("main", "compress")}


class V4Model(nn.Module):
    def __init__(self, cfg: V4Config, prepare_layer: Callable[[nn.Module], None] | None = None) -> None:
        """prepare_layer: called on each decoder layer as soon as it is built (the engine's
        formats.prepare_layer: layers held in FP8 / FP4 never exist whole in BF16)."""
        super().__init__()
        self.cfg = cfg
        check_group(cfg, current_tp_group())   # a clear error before any layer is built
        self.rotaries = nn.ModuleDict(build_rotaries(cfg))
        # The vocabulary is split over tensor-parallel ranks (a plain embedding on one rank).
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList()
        for t, m in zip(cfg.layer_types, cfg.mlp_types):
            self.layers.append(V4DecoderLayer(cfg, t, m, self.rotaries))
            if prepare_layer is not None:
                prepare_layer(self.layers[-1])
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)

    def streams(self, token_ids: torch.Tensor, state: V4State) -> torch.Tensor:
        """token_ids [B, L] continuing `state` -> the last layer's streams [B, L, hc_mult, hidden]
        (what an MTP layer reads); advances state.seen by L."""
        positions = torch.arange(token_ids.shape[1], device=token_ids.device) + state.seen
        x = self.embed_tokens(token_ids)
        h = x.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        for layer, layer_state in zip(self.layers, state.layers):
            h = layer(h, positions, layer_state, token_ids)
        state.seen += token_ids.shape[1]
        return h

    def forward(self, token_ids: torch.Tensor, state: V4State) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final hidden [B, L, hidden], streams [B, L, hc_mult, hidden])."""
        h = self.streams(token_ids, state)
        return self.norm(self.hc_head(h)), h


class V4ForCausalLM(nn.Module):
    def __init__(self, cfg: V4Config | dict[str, Any], with_mtp: bool = True) -> None:
        super().__init__()
        cfg = cfg if isinstance(cfg, V4Config) else V4Config.from_hf(cfg)
        self.cfg = cfg
        self.model = V4Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Checkpoint keys mtp.{i}.*; transformers drops them, so they load only here.
        self.mtp = nn.ModuleList([V4MTPLayer(cfg, t, self.model.rotaries) for t in cfg.mtp_layer_types]
                                 if with_mtp else [])

    def new_state(self) -> V4State:
        return V4State.empty(self.cfg.layer_types, [] if not len(self.mtp) else self.cfg.mtp_layer_types)

    def forward(self, token_ids: torch.Tensor, state: V4State | None = None) -> torch.Tensor:
        """Logits [B, L, vocab] for token_ids [B, L] after whatever `state` has seen (a fresh
        state when None: a prefill from position 0)."""
        hidden, _ = self.model(token_ids, self.new_state() if state is None else state)
        return self.lm_head(hidden)

    def mtp_logits(self, streams: torch.Tensor, next_ids: torch.Tensor, state: V4State, depth: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer `depth` on the main model's streams of positions p..p+L-1 and the tokens at
        p+1..p+L: logits for the tokens at p+2..p+L+1 (and the MTP streams, for a next depth)."""
        start = state.seen - streams.shape[1]
        positions = torch.arange(streams.shape[1], device=streams.device) + start
        return self.mtp[depth](streams, next_ids, positions, state.mtp[depth], self.model.embed_tokens,
                               self.lm_head)

    @torch.no_grad()
    def generate_greedy(self, prompt: torch.Tensor, new_tokens: int, first_chunk: int | None = None
                        ) -> torch.Tensor:
        """Greedy continuation of prompt [B, L]: a prefill (in two calls when first_chunk is
        given), then one call per new token, all through one V4State."""
        state = self.new_state()
        if first_chunk:
            self(prompt[:, :first_chunk], state)
            logits = self(prompt[:, first_chunk:], state)
        else:
            logits = self(prompt, state)
        out = []
        for _ in range(new_tokens):
            token = logits[:, -1].argmax(-1, keepdim=True)
            out.append(token)
            logits = self(token, state)
        return torch.cat(out, dim=1)
