"""RMSNorm in the two conventions found in HF checkpoints.

Both take an optional `residual`: `norm(x, residual)` adds x into the residual stream and
normalises the sum, returning (normed, new residual), which is how decoder layers carry
(hidden, residual) from one half to the next. On the CUDA fast path (attention backend "triton")
that is one Triton kernel that updates the residual in place (deepinfer/layers/fused/rms_norm.py);
the PyTorch code below is the reference it is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers import fused


class RMSNorm(nn.Module):
    """Llama convention: x / rms(x) * weight. (HF normalises in float32 and scales after the
    cast back; torch's fused kernel also accumulates in float32 and scales before the cast,
    which is identical in float32 and within one bf16 rounding otherwise.)"""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if fused.enabled():
            from deepinfer.layers.fused.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        residual = residual + x
        return F.rms_norm(residual, residual.shape[-1:], self.weight, self.eps), residual


class GemmaRMSNorm(nn.Module):
    """Gemma convention: the stored weight is an offset, the scale is (1 + weight), all in float32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if fused.enabled():
            from deepinfer.layers.fused.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, weight_offset=1.0)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), x.shape[-1:], 1.0 + self.weight.float(), self.eps).to(x.dtype)
