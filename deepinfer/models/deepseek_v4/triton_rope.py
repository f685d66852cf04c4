"""V4's rotary embedding (rope.py: interleaved pairs in the trailing rope_dim channels of a head)
in one Triton kernel a call.

rope.V4Rotary.rotate in PyTorch is about fifteen kernels (strided halves, products, a stack, a
cat and the casts); each V4 layer rotates its queries, its KV row, the indexer's queries, the
compressors' pooled rows and, inverted, its attention output, so at decode those launches cost
more than the data they move. The kernel writes the whole rotated copy: the leading "nope"
channels as they are, each pair (2i, 2i + 1) of the last rope_dim turned by its token's angle.
The angles' cos and sin come from PyTorch (V4Rotary.cos_sin, the reference's own tables: Triton's
cos may be an approximation), so the products are the reference's but for a GPU's fused
multiply-adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_HEADS = 16


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, positions_len, stride_xr, stride_xh,
                 NOPE: tl.constexpr, NOPE_PAD: tl.constexpr, HALF: tl.constexpr, INVERSE: tl.constexpr,
                 BLOCK_HEADS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    token = row % positions_len
    h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    h_ok = h < heads
    dim = NOPE + 2 * HALF
    src = x_ptr + row * stride_xr + h[:, None].to(tl.int64) * stride_xh
    dst = out_ptr + (row * heads + h[:, None].to(tl.int64)) * dim
    if NOPE > 0:
        c = tl.arange(0, NOPE_PAD)
        keep = h_ok[:, None] & (c < NOPE)[None, :]
        tl.store(dst + c[None, :], tl.load(src + c[None, :], mask=keep), mask=keep)
    p = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + token * HALF + p)
    sin = tl.load(sin_ptr + token * HALF + p)
    if INVERSE:
        sin = -sin
    even = tl.load(src + NOPE + 2 * p[None, :], mask=h_ok[:, None]).to(tl.float32)
    odd = tl.load(src + NOPE + 2 * p[None, :] + 1, mask=h_ok[:, None]).to(tl.float32)
    kind = out_ptr.dtype.element_ty
    tl.store(dst + NOPE + 2 * p[None, :], (even * cos[None, :] - odd * sin[None, :]).to(kind), mask=h_ok[:, None])
    tl.store(dst + NOPE + 2 * p[None, :] + 1, (odd * cos[None, :] + even * sin[None, :]).to(kind), mask=h_ok[:, None])


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], inverse: bool = False) -> torch.Tensor:
    """rope.V4Rotary.rotate: x [..., tokens, heads, dim] with its positions' tables (cos, sin
    [tokens, rope_dim / 2], V4Rotary.cos_sin) -> a new tensor, x's shape and dtype, its last
    rope_dim channels turned (back, with inverse)."""
    cos, sin = (t.contiguous() for t in tables)
    *lead, heads, dim = x.shape
    half = cos.shape[-1]
    nope = dim - 2 * half
    if half & (half - 1):
        raise ValueError(f"V4's fused rope takes rope_dim a power of two times 2, not {2 * half}")
    rows = x.reshape(-1, heads, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rope_kernel[(rows.shape[0], triton.cdiv(heads, BLOCK_HEADS))](
            rows, cos, sin, out, heads, cos.shape[0], rows.stride(0), rows.stride(1),
            NOPE=nope, NOPE_PAD=triton.next_power_of_2(max(nope, 1)), HALF=half, INVERSE=inverse,
            BLOCK_HEADS=BLOCK_HEADS)
    return out
