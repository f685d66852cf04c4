"""Rotary position embeddings (the rotate-half layout HF checkpoints use), with rope scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from deepinfer.layers.attention.metadata import current_backend

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of one layer type, from either config convention.

    transformers >= 5 writes `rope_parameters` (per layer type for hybrid models such as Gemma 3);
    older configs write `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`).
    """
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params and isinstance(params[layer_type], dict):
        return dict(params[layer_type])
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    out = dict(hf_config.get("rope_scaling") or {})
    out.setdefault("rope_type", out.pop("type", "default"))
    theta = hf_config.get("rope_theta", 10000.0)
    if layer_type == "sliding_attention" and "rope_local_base_freq" in hf_config:
        theta, out = hf_config["rope_local_base_freq"], {"rope_type": "default"}
    out["rope_theta"] = theta
    return out


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Applies rope to q and k of shape [tokens, heads, head_dim] at the given positions.

    Where the forward's backend turns on `fused_rotary` (the CUDA fast path) one Triton kernel
    rotates q and k in place (deepinfer/layers/fused/rotary.py). Where it turns on
    `short_cpu_rotary` (the CPU fast path) `rotate` does it in three eager ops instead of the
    reference's seven per tensor, and models rotate q and k together where they lie side by side
    in the fused qkv output. The reference is `forward` on the other backends."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position: int) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Kept in float32; cast per call to the activation dtype, as HF does.
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

        self._cached: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        self._cached_fast: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        backend = current_backend()
        if backend.fused_rotary:
            from deepinfer.layers.fused.rotary import apply_rotary_
            return apply_rotary_(positions, q, k, self.cos, self.sin)
        if backend.short_cpu_rotary:
            return self.rotate(positions, q), self.rotate(positions, k)
        # Layers share one RotaryEmbedding per rope setting, and within a forward they all pass
        # the same positions tensor: look the rows up once.
        cached = self._cached
        if cached is None or cached[0] is not positions or cached[1] != q.dtype:
            cached = (positions, q.dtype, self.cos[positions].to(q.dtype).unsqueeze(1),
                      self.sin[positions].to(q.dtype).unsqueeze(1))
            self._cached = cached
        cos, sin = cached[2], cached[3]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] (any strides) rotated, as a new contiguous tensor.

        With x = [x1 | x2] and rotate_half(x) * sin = [-x2 * sin | x1 * sin] (the table repeats
        its first half), that term is x with its halves swapped (one flip) times a sign-folded
        sine [-sin | sin]; x * cos is then added in place (addcmul_: one rounding instead of the
        reference's two, so bf16 results may differ from it in the last bit)."""
        cached = self._cached_fast
        if cached is None or cached[0] is not positions or cached[1] != x.dtype:
            half = self.cos.shape[-1] // 2
            sin = self.sin[positions, :half]
            signed_sin = torch.cat((-sin, sin), dim=-1).to(x.dtype).view(-1, 1, 2, half)
            cached = (positions, x.dtype, self.cos[positions].to(x.dtype).unsqueeze(1), signed_sin)
            self._cached_fast = cached
        cos, signed_sin = cached[2], cached[3]
        swapped = x.unflatten(-1, (2, -1)).flip(-2)
        return swapped.mul_(signed_sin).flatten(-2).addcmul_(x, cos)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
