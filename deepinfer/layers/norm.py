"""RMSNorm in the two conventions found in HF checkpoints.

Both take an optional `residual`: `norm(x, residual)` adds x into the residual stream and
normalises the sum, returning (normed, new residual), which is how decoder layers carry
(hidden, residual) from one half to the next. Where the forward's backend turns on `fused_norm`
(the CUDA fast path) that is one Triton kernel that updates the residual in place
(deepinfer/layers/fused/rms_norm.py); where it turns on `short_cpu_norm` (the CPU fast path) a
shorter chain of eager ops (rms_norm_cpu). F.rms_norm below is the reference both are tested
against.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.attention.metadata import current_backend


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
        backend = current_backend()
        if backend.fused_norm:
            from deepinfer.layers.fused.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)
        if backend.short_cpu_norm:
            return rms_norm_cpu(x, self.weight, self.eps, residual)
        norm = F.rms_norm
        if residual is None:
            return norm(x, x.shape[-1:], self.weight, self.eps)
        residual = residual + x
        return norm(residual, residual.shape[-1:], self.weight, self.eps), residual


# Up to this many rows (decode batches) the bf16 norm runs as one layer norm over [x, -x]
# (rms_norm_cpu); above, the cat costs more than the ops it saves. On a 2-core AMD EPYC, 576
# wide, residual add included, the layer norm was faster at 1 row and at 32 but slower at 128
# (docs/benchmarks/design-measurements.md#cpu-rms-norm-as-a-layer-norm).
LAYER_NORM_MAX_ROWS = 32


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward on the CPU fast path (AttentionBackend.short_cpu_norm): the residual add,
    then the norm in HF's rounding order, in as few eager ops as there are (a SmolLM2 step calls
    this 61 times, and on the CPU each op costs a few microseconds whatever its size).

    In bf16 the norm runs as a layer norm of [x, -x]: that row has mean 0 and variance mean(x^2),
    so its first half is x * rsqrt(mean(x^2) + eps), and torch's layer norm is one fused CPU
    kernel that accumulates in float32 and rounds once to bf16, where rms_norm is a chain of
    about ten ops (and _rms_norm_cpu six, two of them with hidden dtype copies). The weight is
    applied after that rounding, as HF does. Above LAYER_NORM_MAX_ROWS rows, and in float32,
    _rms_norm_cpu runs instead: in float32 the mean that layer norm subtracts is not exactly 0
    and costs a few ulps (float32 is what the parity tests against transformers run)."""
    if residual is not None:
        residual = residual + x
        x = residual
    if x.dtype == torch.bfloat16 and x.numel() <= LAYER_NORM_MAX_ROWS * x.shape[-1]:
        size = x.shape[-1]
        out = F.layer_norm(torch.cat((x, x.neg()), dim=-1), (2 * size,), None, None, eps)
        out = torch.mul(out[..., :size], weight)   # a new tensor: the half is strided above one row
    else:
        out = _rms_norm_cpu(x, x.shape[-1:], weight, eps)
    return out if residual is None else (out, residual)


def _rms_norm_cpu(x: torch.Tensor, shape: torch.Size, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The CPU fast path's RMSNorm (AttentionBackend.short_cpu_norm), in HF's rounding order.

    torch's rms_norm runs on the CPU as a chain of about ten small ops (upcast, pow, mean, add,
    rsqrt, multiply, downcast, ...), and a SmolLM2 step calls it 61 times, so every op saved is
    saved 61 times a step (docs/benchmarks/design-measurements.md#cpu-rms-norm).
    Here the sum of squares comes from one float32 reduction straight off the bf16 input
    (vector_norm with dtype=float32: no upcast copy), and x * rsqrt is written straight into a
    tensor of x's dtype: six ops. Rounding is HF's: (x.float() * rsqrt(mean(x^2) + eps)) rounded
    to x's dtype, then times the weight.
    """
    size = x.shape[-1]
    inv = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    inv = torch.addcmul(_scalar_tensor(eps), inv, inv, value=1.0 / size).rsqrt_()   # 1/sqrt(mean + eps)
    return torch.mul(x, inv, out=torch.empty_like(x)).mul_(weight)


@functools.cache
def _scalar_tensor(value: float) -> torch.Tensor:
    """A 0-dim float32 tensor of `value`, made once (addcmul's base must be a tensor)."""
    return torch.tensor(value, dtype=torch.float32)


class GemmaRMSNorm(nn.Module):
    """Gemma convention: the stored weight is an offset, the scale is (1 + weight), all in float32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if current_backend().fused_norm:
            from deepinfer.layers.fused.rms_norm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, weight_offset=1.0)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), x.shape[-1:], 1.0 + self.weight.float(), self.eps).to(x.dtype)
