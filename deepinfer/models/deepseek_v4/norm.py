"""The two RMSNorms V4 uses. Both normalise in float32; the weighted one keeps its weight in
float32 (the checkpoint ships these in float32) and rounds to the input dtype once at the end."""

from __future__ import annotations

import torch
from torch import nn


class V4RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) with no weight (the per-head query norm, and mHC's input norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
