"""Linear layers, with an optional 4-bit weight copy for small-batch CPU decode.

GGUF files store most projections as 4-bit blocks (Q4_0/Q4_1: 32 weights share a scale and an
offset). That is exactly torch's int4 group-quantized layout, so such weights can be kept
4-bit and multiplied by `_weight_int4pack_mm_for_cpu` without re-quantizing. It reads a quarter
of bf16's bytes, which wins where decode is memory-bound (a few rows); at larger batches the
dense bf16 matmul is faster, so both copies are kept and `forward` picks by the row count.
The dense weight is always the exact dequantization, and stays the reference path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 32
# Above this many rows the dense bf16 matmul beats the int4 kernel on the CPUs we measured
# (see docs/benchmarks.md, "CPU weight formats").
INT4_MAX_ROWS = 8


@dataclass
class Int4Blocks:
    """A [rows, cols] weight as w = scale * q + offset, per group of 32 columns.

    q: uint8 [rows, cols] in 0..15; scale, offset: float32 [rows, cols // 32].
    """

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        w = self.q.astype(np.float32).reshape(self.q.shape[0], -1, INT4_GROUP)
        w = w * self.scale[..., None] + self.offset[..., None]
        return torch.from_numpy(w.reshape(self.q.shape))

    @staticmethod
    def concat(parts: list[Int4Blocks]) -> Int4Blocks:
        return Int4Blocks(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]),
                          np.concatenate([p.offset for p in parts]))


class Linear(nn.Linear):
    """nn.Linear that may also hold an int4 copy of its weight (see the module docstring)."""

    int4_weight: torch.Tensor | None = None
    int4_scales_zeros: torch.Tensor | None = None

    def set_int4(self, blocks: Int4Blocks) -> None:
        if (self.weight.device.type != "cpu" or not hasattr(torch, "_weight_int4pack_mm_for_cpu")
                or blocks.q.shape[1] % INT4_GROUP):
            return  # no CPU int4 kernel here: the dense weight serves alone
        q = torch.from_numpy(blocks.q.astype(np.int32))
        self.int4_weight = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # torch's layout: w = (q - 8) * scale + zero, scales_and_zeros [cols/32, rows, 2].
        scale = torch.from_numpy(blocks.scale)
        zero = torch.from_numpy(blocks.offset) + 8 * scale
        self.int4_scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.int4_weight is not None and x.dtype == torch.bfloat16 and x.dim() == 2
                and x.shape[0] <= INT4_MAX_ROWS):
            y = torch._weight_int4pack_mm_for_cpu(x, self.int4_weight, INT4_GROUP, self.int4_scales_zeros)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """A Linear whose output rows are the concatenation of several HF projections."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def shard(self, index: int) -> slice:
        start = sum(self.shard_sizes[:index])
        return slice(start, start + self.shard_sizes[index])
