"""Llama family: Llama (incl. SmolLM2 and Llama-3 rope scaling), Mistral (sliding window),
Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm). One implementation, switched by config fields."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed import current_tp_group
from deepinfer.kv_cache.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from deepinfer.layers.attention import Attention
from deepinfer.layers.attention.metadata import current_backend
from deepinfer.layers.norm import RMSNorm, rms_norm_cpu
from deepinfer.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from deepinfer.layers.rotary import RotaryEmbedding, rope_parameters
from deepinfer.models.base import CausalLM


def head_dim_of(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def layer_types_of(cfg: dict[str, Any]) -> list[str]:
    """'sliding_attention' or 'full_attention' per layer, from `layer_types` or the legacy fields."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    window = cfg.get("sliding_window")
    # Qwen2/3 carry a sliding_window value but only use it when use_sliding_window is set.
    uses_window = window is not None and cfg.get("use_sliding_window", cfg.get("model_type") == "mistral")
    return ["sliding_attention" if uses_window else "full_attention"] * n


def local_kv_heads(cfg: dict[str, Any], tp_size: int) -> int:
    """KV heads one tensor-parallel rank holds: its share, or one replicated head when there are
    fewer heads than ranks (layers/parallel.py)."""
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return max(heads // tp_size, 1)


def kv_cache_specs_of(cfg: dict[str, Any], dtype: torch.dtype, tp_size: int = 1) -> list[KVCacheSpec]:
    """Per layer: a sliding-window spec for sliding layers, a full-attention spec otherwise, for
    the KV heads of one tensor-parallel rank."""
    heads, dim = local_kv_heads(cfg, tp_size), head_dim_of(cfg)
    return [SlidingWindowSpec(heads, dim, dtype, sliding_window=cfg["sliding_window"]) if t == "sliding_attention"
            else FullAttentionSpec(heads, dim, dtype) for t in layer_types_of(cfg)]


def build_rotaries(cfg: dict[str, Any]) -> nn.ModuleDict:
    """One RotaryEmbedding per layer type (rope bases differ by type in Gemma 3), shared by
    every layer of that type so the cos/sin rows are looked up once per forward."""
    return nn.ModuleDict({t: RotaryEmbedding(head_dim_of(cfg), rope_parameters(cfg, t),
                                             cfg.get("max_position_embeddings", 8192))
                          for t in sorted(set(layer_types_of(cfg)))})


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_id: int, rotaries: nn.ModuleDict, *,
                 norm_cls: type[nn.Module] = RMSNorm, scale: float | None = None) -> None:
        super().__init__()
        # Under tensor parallelism a rank holds its share of the query heads and of the KV heads
        # (one replicated KV head when they are fewer than the ranks): heads stay whole.
        tp = current_tp_group()
        total_heads = cfg["num_attention_heads"]
        total_kv_heads = cfg.get("num_key_value_heads") or total_heads
        self.head_dim = head_dim_of(cfg)
        hidden = cfg["hidden_size"]
        qkv_bias = bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2"
        o_bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = ColumnParallelLinear(
            hidden, [total_heads * self.head_dim, total_kv_heads * self.head_dim, total_kv_heads * self.head_dim],
            bias=qkv_bias, units=[total_heads, total_kv_heads, total_kv_heads])
        self.num_heads = self.qkv_proj.shard_sizes[0] // self.head_dim
        self.num_kv_heads = local_kv_heads(cfg, tp.size)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias)
        self.has_qk_norm = cfg.get("model_type") in ("qwen3", "gemma3_text", "gemma3")
        if self.has_qk_norm:
            self.q_norm = norm_cls(self.head_dim, cfg["rms_norm_eps"])
            self.k_norm = norm_cls(self.head_dim, cfg["rms_norm_eps"])
        layer_type = layer_types_of(cfg)[layer_id]
        # A plain attribute, not a submodule: the model owns it, layers share it.
        self.__dict__["rotary"] = rotaries[layer_type]
        window = cfg.get("sliding_window") if layer_type == "sliding_attention" else None
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
                              scale if scale is not None else self.head_dim ** -0.5, window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if not self.has_qk_norm and current_backend().short_cpu_rotary:
            # CPU fast path: q and k lie side by side in qkv, so one rotation covers both.
            heads = self.num_heads + self.num_kv_heads
            qk = self.rotary.rotate(positions, qkv[:, :heads * self.head_dim].view(-1, heads, self.head_dim))
            v = qkv[:, heads * self.head_dim:].view(-1, self.num_kv_heads, self.head_dim)
            return self.o_proj(self.attn(qk[:, :self.num_heads], qk[:, self.num_heads:], v))
        q, k, v = qkv.split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # The attention layer applies the rotary: on the CUDA fast path in the kernel that writes K/V.
        return self.o_proj(self.attn(q, k, v, positions, self.rotary))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if current_backend().fused_activation:   # one kernel (deepinfer/layers/fused/activation.py)
            from deepinfer.layers.fused.activation import act_and_mul
            return self.down_proj(act_and_mul(gate_up, self.act))
        gate, up = gate_up.chunk(2, dim=-1)
        if self.act == "silu":
            gate = F.silu(gate)
        elif self.act == "gelu_pytorch_tanh":
            gate = F.gelu(gate, approximate="tanh")
        else:
            raise ValueError(f"activation {self.act!r} is not supported")
        return self.down_proj(gate * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_id: int, rotaries: nn.ModuleDict) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotaries)
        self.mlp = GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], cfg.get("hidden_act", "silu"),
                            bias=bool(cfg.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out: the residual stream is `residual`, and `hidden` is the
        last block's output not yet added to it. Each norm adds it in and normalises the sum in
        one step (one kernel on the fast path); the first layer gets residual None.
        `keep_rows`: only these rows continue past attention (CausalLM.forward's logits_rows)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        if keep_rows is not None:
            hidden, residual = hidden[keep_rows], residual[keep_rows]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class CpuLayerPlan:
    """One plain Llama decoder layer as the CPU fast path runs it (AttentionBackend.flat_cpu_layers):
    the same ops as LlamaDecoderLayer.forward on that path (rms_norm_cpu, the fused qkv with q and
    k rotated together, the backend's attention, SiLU * up), called on tensors and modules held
    here in plain attributes. A one-row decode step is a few hundred small ops whose dispatch is
    most of its cost, and the module path adds about thirty Python-level calls a layer on top
    (nn.Module.__call__, nn.Module.__getattr__ for every submodule and parameter, a backend look-up
    per op): this is that layer without them. The module forward stays the reference, and
    tests/unit/test_cpu_fast_path.py checks the two give the same logits.

    Only layers without q/k norms, tensor parallelism or other activations than SiLU get a plan
    (plan_of); the weights are the modules' own tensors, updated in place by load_weights, so a
    plan built after loading stays valid."""

    def __init__(self, layer: LlamaDecoderLayer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = (layer.input_layernorm.weight, layer.input_layernorm.eps)
        self.post_norm = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        self.qkv, self.qkv_bias = attn.qkv_proj, attn.qkv_proj.bias
        self.o, self.o_bias = attn.o_proj, attn.o_proj.bias
        self.gate_up, self.gate_up_bias = mlp.gate_up_proj, mlp.gate_up_proj.bias
        self.down, self.down_bias = mlp.down_proj, mlp.down_proj.bias
        self.rotary, self.attn = attn.rotary, attn.attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    @staticmethod
    def plan_of(layer: LlamaDecoderLayer) -> CpuLayerPlan | None:
        attn = layer.self_attn
        projections = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        plain = (type(layer) is LlamaDecoderLayer and not attn.has_qk_norm and layer.mlp.act == "silu"
                 and attn.qkv_proj.group.size == 1 and type(layer.input_layernorm) is RMSNorm
                 and type(layer.post_attention_layernorm) is RMSNorm
                 and all(p.lora is None for p in projections))   # LoRA products: the module path
        return CpuLayerPlan(layer) if plain else None

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                 keep_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, rms_norm_cpu(hidden, *self.input_norm)
        else:
            hidden, residual = rms_norm_cpu(hidden, *self.input_norm, residual)
        qkv = self.qkv.matmul(hidden, self.qkv_bias)
        heads, dim = self.num_heads + self.num_kv_heads, self.head_dim
        qk = self.rotary.rotate(positions, qkv[:, :heads * dim].view(-1, heads, dim))
        v = qkv[:, heads * dim:].view(-1, self.num_kv_heads, dim)
        hidden = self.o.matmul(self.attn.forward(qk[:, :self.num_heads], qk[:, self.num_heads:], v), self.o_bias)
        if keep_rows is not None:
            hidden, residual = hidden[keep_rows], residual[keep_rows]
        hidden, residual = rms_norm_cpu(hidden, *self.post_norm, residual)
        gate, up = self.gate_up.matmul(hidden, self.gate_up_bias).chunk(2, dim=-1)
        return self.down.matmul(F.silu(gate).mul_(up), self.down_bias), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.rotary_embs = build_rotaries(cfg)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, self.rotary_embs)
                                    for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        last = len(self.layers) - 1
        layers = self.cpu_plans() if current_backend().flat_cpu_layers else self.layers
        for i, layer in enumerate(layers):
            hidden, residual = layer(positions, hidden, residual, logits_rows if i == last else None)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]

    def cpu_plans(self) -> list[CpuLayerPlan] | nn.ModuleList:
        """The layers as CpuLayerPlans, built on the first forward that asks (after loading);
        the modules themselves if any layer has no plan."""
        plans = self.__dict__.get("_cpu_plans")
        if plans is None:
            plans = [CpuLayerPlan.plan_of(layer) for layer in self.layers]
            plans = self.__dict__["_cpu_plans"] = plans if all(plans) else self.layers
        return plans

    def forget_layer_plans(self) -> None:
        """The layers changed in a way a plan does not follow (LoRA adapters attached): the next
        forward decides afresh."""
        self.__dict__.pop("_cpu_plans", None)


class LlamaForCausalLM(CausalLM):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__(hf_config)
        self.model = LlamaModel(hf_config)
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(hf_config["hidden_size"], hf_config["vocab_size"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, logits_rows)

    def kv_cache_specs(self, dtype: torch.dtype) -> list[KVCacheSpec]:
        return kv_cache_specs_of(self.hf_config, dtype, self.tp.size)


# Same code, different config fields (see LlamaAttention and layer_types_of).
MistralForCausalLM = LlamaForCausalLM
Qwen2ForCausalLM = LlamaForCausalLM
Qwen3ForCausalLM = LlamaForCausalLM
