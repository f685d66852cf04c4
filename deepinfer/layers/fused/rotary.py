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

`rotate_and_write_kv_` does the same rotation and also writes this step's K (rotated) and V into
the paged KV caches at their slots, the job of kv_write.py: one kernel instead of two per
layer, and the rotated K goes to the cache straight from registers. Attention layers on the
fast path call it (layers/attention/layer.py); `apply_rotary_` stays for rotation alone.

Partial rotary (rotating only the first part of each head) is not supported, here or in the
reference: the tables must be as wide as the head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.kv_cache.dtypes import is_fp8
from deepinfer.layers.fused import pdl_enabled, pdl_launch
from deepinfer.layers.fused.kv_write import round_to_fp8


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
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcr, stride_kch, stride_vcr, stride_vch, stride_table,
    num_heads, num_kv_heads, half,
    HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, WRITE_KV: tl.constexpr,
    FP8_CACHE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per token: rotate its q and k heads in place, and with WRITE_KV also store the
    rotated k and the v at the token's cache slot (the v and cache arguments are unused without).
    With FP8_CACHE, k and v are also left in place as the fp8 cache holds them."""
    if USE_PDL:   # see fused/__init__.py: nothing from earlier kernels is read before this
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    # Only the first half of a table row: the second half repeats it.
    cos = tl.load(cos_ptr + pos * stride_table + dims, mask=dims < half, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + dims, mask=dims < half, other=0.0)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, half, cos, sin, HEADS_PAD, HALF_PAD)
    if not WRITE_KV:
        _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, half, cos, sin, KV_HEADS_PAD, HALF_PAD)
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)   # int64: rows * row size can pass 2**31
        heads = tl.arange(0, KV_HEADS_PAD)[:, None]
        mask = (heads < num_kv_heads) & (dims[None, :] < half)
        k_first = k_ptr + token * stride_kt + heads * stride_kh + dims[None, :]
        k1 = tl.load(k_first, mask=mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_first + half, mask=mask, other=0.0).to(tl.float32)
        r1 = (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty)
        r2 = (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty)
        v_first = v_ptr + token * stride_vt + heads * stride_vh + dims[None, :]
        v1 = tl.load(v_first, mask=mask)
        v2 = tl.load(v_first + half, mask=mask)
        if FP8_CACHE:   # round k and v to the cached values, in place too (kv_cache/dtypes.py)
            r1 = round_to_fp8(r1, k_cache_ptr.dtype.element_ty)
            r2 = round_to_fp8(r2, k_cache_ptr.dtype.element_ty)
            v1 = round_to_fp8(v1, v_cache_ptr.dtype.element_ty)
            v2 = round_to_fp8(v2, v_cache_ptr.dtype.element_ty)
            tl.store(v_first, v1.to(v_ptr.dtype.element_ty), mask=mask)
            tl.store(v_first + half, v2.to(v_ptr.dtype.element_ty), mask=mask)
        # In place too: fresh prefill chunks attend over k itself.
        tl.store(k_first, r1.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(k_first + half, r2.to(k_ptr.dtype.element_ty), mask=mask)
        kc_first = k_cache_ptr + slot * stride_kcr + heads * stride_kch + dims[None, :]
        tl.store(kc_first, r1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(kc_first + half, r2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        vc_first = v_cache_ptr + slot * stride_vcr + heads * stride_vch + dims[None, :]
        tl.store(vc_first, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_first + half, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    head_dim = q.shape[-1]
    if cos.shape[-1] != head_dim or head_dim % 2:
        raise ValueError(f"rotary tables of width {cos.shape[-1]} for heads of {head_dim}: "
                         "partial rotary is not supported")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("q, k and the rotary tables must be contiguous in their last dim")


def _tiles(num_heads: int, num_kv_heads: int, half: int) -> dict:
    """Tile sizes: padded to powers of two (tl.arange needs them), and to at least 2 so that no
    tile has a dimension of 1 (Gemma 3 270M has a single KV head); about 8 elements of each half
    per thread (Llama-3-8B's 32 x 64 q tile: 8 warps), so that large head counts do not run out
    of registers."""
    heads_pad, half_pad = max(2, triton.next_power_of_2(num_heads)), max(2, triton.next_power_of_2(half))
    return dict(HEADS_PAD=heads_pad, KV_HEADS_PAD=max(2, triton.next_power_of_2(num_kv_heads)), HALF_PAD=half_pad,
                num_warps=max(4, min(16, heads_pad * half_pad // 256)), USE_PDL=pdl_enabled(), **pdl_launch())


def apply_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] in place at
    `positions` [tokens]; cos/sin: [max_position, head_dim] float32 tables. Returns (q, k)."""
    _check(q, k, cos, sin)
    tokens, num_heads, head_dim = q.shape
    if tokens:
        _rotary_kernel[(tokens,)](
            q, k, k, k, k, positions, positions, cos, sin,   # no v, caches or slots: WRITE_KV off
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), 0, 0, 0, 0, 0, 0, cos.stride(0),
            num_heads, k.shape[1], head_dim // 2, WRITE_KV=False, FP8_CACHE=False,
            **_tiles(num_heads, k.shape[1], head_dim // 2),
        )
    return q, k


def rotate_and_write_kv_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """apply_rotary_(positions, q, k, cos, sin), then k_cache[slot_mapping[t]] = k[t] and
    v_cache[slot_mapping[t]] = v[t] for every token t, in one kernel. Caches: [rows, kv_heads,
    head_dim] (cast on the way to their dtype), as write_kv_cache takes them. Into fp8 caches
    the values are clamped and rounded, and k and v are overwritten with the rounded values
    (kv_cache/dtypes.py: attention sees K/V as cached)."""
    _check(q, k, cos, sin)
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if (v.shape != k.shape or slot_mapping.shape != (tokens,) or k_cache.shape[1:] != k.shape[1:]
            or v_cache.shape[1:] != k.shape[1:]):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slot_mapping.shape)} do not "
                         f"fit caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("v and the caches must be contiguous in their last dim")
    if tokens:
        _rotary_kernel[(tokens,)](
            q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), cos.stride(0),
            num_heads, num_kv_heads, head_dim // 2, WRITE_KV=True, FP8_CACHE=is_fp8(k_cache.dtype),
            **_tiles(num_heads, num_kv_heads, head_dim // 2),
        )
