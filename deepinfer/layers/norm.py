"""RMSNorm in the two conventions found in HF checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama convention: x / rms(x) * weight. (HF normalises in float32 and scales after the
    cast back; torch's fused kernel also accumulates in float32 and scales before the cast,
    which is identical in float32 and within one bf16 rounding otherwise.)"""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma convention: the stored weight is an offset, the scale is (1 + weight), all in float32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), x.shape[-1:], 1.0 + self.weight.float(), self.eps).to(x.dtype)
