"""The two RMSNorms V4 uses. Both normalise in float32; the weighted one keeps its weight in
float32 (the checkpoint ships these in float32) and rounds to the input dtype once at the end.
Where the forward's backend turns on fused_norm (V4's Triton path) each is one Triton kernel
(layers/fused/rms_norm.py); these PyTorch ops are the reference it is tested against."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.layers.attention.metadata import current_backend


class V4RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if current_backend().fused_norm:
            from deepinfer.layers.fused.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) with no weight (the per-head query norm, and mHC's input norm). The fused
    kernel rounds once (x * rstd in float32); this rounds rstd to x's dtype first, as
    transformers does: the same in float32, within a rounding in bf16."""
    if current_backend().fused_norm:
        from deepinfer.layers.fused.rms_norm import rms_norm
        return rms_norm(x, None, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
