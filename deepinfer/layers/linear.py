"""Linear layers, with an optional 4-bit weight copy for small-batch CPU decode, and a Triton
matrix-vector kernel for one-row steps on the CUDA fast path (layers/fused/gemv.py).

GGUF files store most projections as 4-bit blocks (Q4_0/Q4_1: 32 weights share a scale and an
offset). That is exactly torch's int4 group-quantized layout, so such weights can be kept
4-bit and multiplied by `_weight_int4pack_mm_for_cpu` without re-quantizing. It reads a quarter
of bf16's bytes, which wins where decode is memory-bound (a few rows); at larger batches the
dense bf16 matmul is faster, so both copies are kept and `forward` picks by the row count.
The dense weight is always the exact dequantization, and stays the reference path. On the CPU
in bf16 the dense products above the int4 crossover run on a copy of the weight packed once in
oneDNN's layout (pack_dense): the same results, faster.

The LM head of GGUF files is often Q8_0 (8-bit, one scale per 32 weights). torch has no CPU
kernel for grouped 8-bit weights, but an 8-bit matrix is exactly the sum of two 4-bit ones
(Int8Blocks.as_int4_pair), so the head can run on the same int4 kernel at half bf16's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.attention.metadata import current_backend
from deepinfer.layers.quantization import fp8

INT4_GROUP = 32
# Above this many rows the dense bf16 matmul (oneDNN-packed, pack_dense) beats the int4 kernel.
# Measured inside the model, where every step streams the weights from memory (a warm loop over
# one layer favours bf16): a SmolLM2 decode forward at 2 to 16 rows was faster with this at 8
# than with the int4 kernel stopping at fewer rows or going on to more. Figures:
# docs/benchmarks/design-measurements.md#int4-max-rows
INT4_MAX_ROWS = 8
# The Q8_0 head as two int4 halves (Int8Blocks.as_int4_pair) reads fewer bytes than the packed bf16
# copy, but does twice the products: it wins at one row only. Figures:
# docs/benchmarks/design-measurements.md#int4-head-rows
HEAD_INT4_MAX_ROWS = 1


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


@dataclass
class Int8Blocks:
    """A [rows, cols] weight as w = scale * q, per group of 32 columns (GGUF's Q8_0).

    q: int8 [rows, cols]; scale: float32 [rows, cols // 32].
    """

    q: np.ndarray
    scale: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        w = self.q.astype(np.float32).reshape(self.q.shape[0], -1, INT4_GROUP) * self.scale[..., None]
        return torch.from_numpy(w.reshape(self.q.shape))

    def as_int4_pair(self) -> Int4Blocks:
        """The same matrix as two 4-bit halves side by side, [rows, 2 * cols], whose products sum
        to the 8-bit one: with u = q + 128 = 16 * hi + lo (hi, lo in 0..15),
            w = s * q = (16 * s * hi - 128 * s) + (s * lo),
        so x @ w.T = [x, x] @ [w_hi, w_lo].T with w_hi = 16s * hi - 128s and w_lo = s * lo.
        Both halves are Int4Blocks exactly (scale and offset per group of 32), so torch's int4
        kernel multiplies an 8-bit matrix without re-quantizing it: the values stay the Q8_0
        values (the scales are kept in bf16 by that kernel, as for Q4 matrices)."""
        u = self.q.astype(np.int16) + 128
        q4 = np.concatenate([u >> 4, u & 15], axis=1).astype(np.uint8)
        scale = np.concatenate([16 * self.scale, self.scale], axis=1)
        offset = np.concatenate([-128 * self.scale, np.zeros_like(self.scale)], axis=1)
        return Int4Blocks(q4, scale, offset)


def int4_available(device: torch.device, cols: int) -> bool:
    """Whether torch has the CPU int4 kernel for a weight of `cols` columns on `device`."""
    return (device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu")
            and cols % INT4_GROUP == 0)


def pack_int4(blocks: Int4Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scales_and_zeros) in the layout `_weight_int4pack_mm_for_cpu` takes."""
    q = torch.from_numpy(blocks.q.astype(np.int32))
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    # torch's layout: w = (q - 8) * scale + zero, scales_and_zeros [cols/32, rows, 2].
    scale = torch.from_numpy(blocks.scale)
    zero = torch.from_numpy(blocks.offset) + 8 * scale
    return packed, torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    return torch._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales_zeros)


def onednn_packing_available(weight: torch.Tensor) -> bool:
    """Whether a bf16 CPU weight can be kept in oneDNN's packed layout (see pack_dense)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a bf16 [out, in] weight in oneDNN's blocked layout, for dense_matmul.

    F.linear hands the plain row-major weight to oneDNN, which reorders it into its own blocked
    layout on every call; packed once at load, the same products (bit for bit: tests check)
    take less time, at every row count timed (figures:
    docs/benchmarks/design-measurements.md#onednn-packing).
    The rows hint picks the layout; every hint from 1 to 128 measured the same.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)


def dense_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def one_row_gemv(x: torch.Tensor) -> bool:
    """Whether x is one row on the CUDA fast path (any leading dims, all of size 1: a [1, 1, K]
    batch-1 token is one row too): its products run on the Triton GEMV."""
    return x.dim() >= 2 and x.numel() == x.shape[-1] and current_backend().fused_gemv


class Linear(nn.Linear):
    """nn.Linear that may also hold an int4 copy of its weight and a oneDNN-packed copy of its
    dense weight (CPU, bf16; see the module docstring and pack_dense). `weight` stays the plain
    dense tensor: what is loaded, and the reference path.

    Or its weight is FP8 (layers/quantization/fp8.py): `weight` holds the float8_e4m3fn codes
    and `weight_scale` their float32 multipliers, per output channel (`to_fp8`, from the loaded
    weight) or per block of `weight_block` (`as_fp8_blocks`, before a checkpoint's FP8 blocks are
    loaded into it); no dense copy is kept."""

    int4_weight: torch.Tensor | None = None
    int4_scales_zeros: torch.Tensor | None = None
    packed_weight: torch.Tensor | None = None
    weight_scale: torch.Tensor | None = None
    weight_block: tuple[int, int] | None = None
    lora = None   # lora/slots.LoRAStack once LoRA adapters are attached

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale is not None

    @torch.no_grad()
    def to_fp8(self) -> None:
        """Replace the (loaded) weight by FP8 codes with one scale per output channel (a layer
        already FP8, a checkpoint's blocks, stays as it is)."""
        if self.is_fp8:
            return
        codes, scale = fp8.quantize_per_channel(self.weight)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale = scale
        self.int4_weight = self.int4_scales_zeros = self.packed_weight = None

    @torch.no_grad()
    def to_fp8_blocks(self, block: tuple[int, int]) -> None:
        """Replace the (loaded) weight by FP8 codes with one scale per `block` (DeepSeek-V4's own
        format, made from a dense weight: `--quantization fp8` on a V4 model); FP8 stays as it is."""
        if self.is_fp8:
            return
        codes, scale = fp8.quantize_blocks(self.weight, block)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale, self.weight_block = scale, block
        self.int4_weight = self.int4_scales_zeros = self.packed_weight = None

    def as_fp8_blocks(self, block: tuple[int, int]) -> None:
        """Make room for a checkpoint's block-scaled FP8 weight: codes [out, in] and scales
        [ceil(out / bn), ceil(in / bk)], filled by the loader (zero codes until then)."""
        out, inner = self.weight.shape
        device = self.weight.device
        self.weight = nn.Parameter(torch.zeros(out, inner, dtype=fp8.FP8, device=device), requires_grad=False)
        self.weight_scale = torch.ones(-(-out // block[0]), -(-inner // block[1]), device=device)
        self.weight_block = block

    def set_int4(self, blocks: Int4Blocks) -> None:
        if not int4_available(self.weight.device, blocks.q.shape[1]):
            return  # no CPU int4 kernel here: the dense weight serves alone
        self.int4_weight, self.int4_scales_zeros = pack_int4(blocks)

    def pack_weight(self) -> None:
        """Keep a oneDNN-packed copy of the (loaded) dense weight, where that is possible."""
        if onednn_packing_available(self.weight):
            self.packed_weight = pack_dense(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        if self.lora is not None:   # adapters attached (lora/slots.py): the step's rows' products
            return self.lora.add(x, y)
        return y

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias), on the fastest copy of the weight for x's rows. A row-parallel
        layer passes no bias: it adds it once, after summing the ranks' products."""
        if one_row_gemv(x):
            # One row on the CUDA fast path: the Triton GEMV, faster than cuBLAS on every matrix
            # timed. A first multi-row version lost to cuBLAS at two rows on most of Llama-3-8B's
            # matrices, so more rows stay on cuBLAS. Figures:
            # docs/benchmarks/design-measurements.md#gemv-one-row
            # FP8 bytes are read as stored and scaled in the GEMV (fused/gemv.py).
            from deepinfer.layers.fused.gemv import gemv  # imports triton: CUDA fast path only
            y = gemv(x.reshape(1, -1), self.weight, bias, scale=self.weight_scale, block=self.weight_block)
            return y.view(*x.shape[:-1], -1)
        if self.weight_scale is not None:
            return fp8.fp8_linear(x, self.weight, self.weight_scale, self.weight_block, bias)
        if x.dtype == torch.bfloat16 and x.dim() == 2:
            if self.int4_weight is not None and x.shape[0] <= INT4_MAX_ROWS:
                y = int4_matmul(x, self.int4_weight, self.int4_scales_zeros)
                return y if bias is None else y + bias
            if self.packed_weight is not None:
                return dense_matmul(x, self.packed_weight, bias)
        return F.linear(x, self.weight, bias)


class FusedLinear(Linear):
    """A Linear whose output rows are the concatenation of several HF projections."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def shard(self, index: int) -> slice:
        start = sum(self.shard_sizes[:index])
        return slice(start, start + self.shard_sizes[index])
