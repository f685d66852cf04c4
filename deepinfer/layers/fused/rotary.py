"""Rotary embedding of q and k in one Triton kernel, in place.

The reference (deepinfer/layers/rotary.py) looks up cos/sin rows, casts them, and computes
`x * cos + rotate_half(x) * sin` for q and for k: a gather, casts, a cat and a neg for each
rotate_half, four multiplies and two adds, each its own kernel writing a new tensor. Here one
program per token reads that token's cos/sin row once and rotates all its q heads and k heads
where they lie (q and k are views into the fused qkv output; rotating them in place costs no
allocation and leaves v untouched).

Layout: rotate-half, as HF checkpoints use. With x = [x1 | x2] split at head_dim / 2 and the
cos/sin tables holding [freqs | freqs] per position (so both halves share one angle per pair):
  out1 = x1 * cos - x2 * sin
  out2 = x2 * cos + x1 * sin
The tables are RotaryEmbedding's float32 buffers, indexed by `positions` on the device (no
host-side lookup, so a CUDA graph replays with whatever positions its input buffer holds). The
math is float32 with one rounding at the end; the reference casts cos/sin to the activation
dtype first, so bf16 results differ from it by about one bf16 rounding.

Partial rotary (rotating only the first part of each head) is not supported, here or in the
reference: the tables must be as wide as the head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(ptr, stride_head, num_heads, half, cos, sin, HEADS_PAD: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    """Rotate the [num_heads, 2 * half] heads of one token starting at `ptr`, in place."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first = ptr + heads * stride_head + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
    num_heads, num_kv_heads, half,
    HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    # Only the first half of a table row: the second half repeats it.
    cos = tl.load(cos_ptr + pos * stride_table + dims, mask=dims < half, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + dims, mask=dims < half, other=0.0)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, half, cos, sin, HEADS_PAD, HALF_PAD)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, half, cos, sin, KV_HEADS_PAD, HALF_PAD)


def apply_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place at
    `positions` [tokens]; cos/sin: [max_position, head_dim] float32 tables. Returns (q, k)."""
    tokens, num_heads, head_dim = q.shape
    if cos.shape[-1] != head_dim or head_dim % 2:
        raise ValueError(f"rotary tables of width {cos.shape[-1]} for heads of {head_dim}: "
                         "partial rotary is not supported")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("q, k and the rotary tables must be contiguous in their last dim")
    if tokens:
        half = head_dim // 2
        # Padded to powers of two (tl.arange needs them), and to at least 2 so that no tile has a
        # dimension of 1 (Gemma 3 270M has a single KV head).
        heads_pad = max(2, triton.next_power_of_2(num_heads))
        half_pad = max(2, triton.next_power_of_2(half))
        _rotary_kernel[(tokens,)](
            q, k, positions, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            num_heads, k.shape[1], half,
            HEADS_PAD=heads_pad, KV_HEADS_PAD=max(2, triton.next_power_of_2(k.shape[1])), HALF_PAD=half_pad,
            # About 8 elements of each half per thread (Llama-3-8B's 32 x 64 q tile: 8 warps), so
            # that large head counts do not run out of registers.
            num_warps=max(4, min(16, heads_pad * half_pad // 256)),
        )
    return q, k
