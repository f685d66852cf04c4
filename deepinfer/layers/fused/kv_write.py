"""This step's K and V written into the paged KV caches in one Triton kernel.

The reference (attention/layer.py) does `k_cache.index_copy_(0, slot_mapping, k.to(dtype))` and
the same for V: two kernels, and a cast each when k/v are strided views of the qkv output (or of
another dtype). Here one program per token reads the token's slot once and copies its K and V
heads, casting on the way, into row `slot` of each cache ([rows, kv_heads, head_dim]).

Slots come from the device (`slot_mapping`), so a CUDA graph writes wherever the replayed step
says; the graph's padding rows all write row 0 of the null block, which nothing reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.kv_cache.dtypes import is_fp8
from deepinfer.layers.fused import pdl_enabled, pdl_launch


@triton.jit
def round_to_fp8(x, fp8_type: tl.constexpr):
    """x (any float type) rounded to the nearest value of an fp8 cache (clamped to e4m3's +-448,
    FP8_MAX in kv_cache/dtypes.py), returned in float32, where it is exact.

    Callers store `.to(fp8_type)` of the result into the cache and `.to(their dtype)` in place.
    Neither store may take the fp8 tensor itself: with Triton 3.6, an fp8 tile stored into the
    cache and converted for an in-place store came back with some of its values garbled or NaN
    (what was seen, where: docs/benchmarks/design-measurements.md#fp8-store-garbling)."""
    return tl.clamp(x.to(tl.float32), -448.0, 448.0).to(fp8_type).to(tl.float32)


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcr, stride_kch, stride_vcr, stride_vch,
    num_kv_heads, head_dim,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, FP8_CACHE: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:   # see fused/__init__.py: nothing from earlier kernels is read before this
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)   # int64: rows * row size can pass 2**31
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k_ptrs = k_ptr + token * stride_kt + heads * stride_kh + dims
    v_ptrs = v_ptr + token * stride_vt + heads * stride_vh + dims
    k = tl.load(k_ptrs, mask=mask)
    v = tl.load(v_ptrs, mask=mask)
    if FP8_CACHE:   # k and v left as the cache holds them, in place (kv_cache/dtypes.py)
        k = round_to_fp8(k, k_cache_ptr.dtype.element_ty)
        v = round_to_fp8(v, v_cache_ptr.dtype.element_ty)
        tl.store(k_ptrs, k.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptrs, v.to(v_ptr.dtype.element_ty), mask=mask)
    tl.store(k_cache_ptr + slot * stride_kcr + heads * stride_kch + dims, k.to(k_cache_ptr.dtype.element_ty),
             mask=mask)
    tl.store(v_cache_ptr + slot * stride_vcr + heads * stride_vch + dims, v.to(v_cache_ptr.dtype.element_ty),
             mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping[t]] = k[t] and v_cache[slot_mapping[t]] = v[t] for every token t.

    k, v: [tokens, kv_heads, head_dim] (any token/head strides); caches: [rows, kv_heads, head_dim].
    Into fp8 caches the values are clamped and rounded, and k and v are overwritten with the
    rounded values (kv_cache/dtypes.py: attention sees K/V as cached)."""
    tokens, num_kv_heads, head_dim = k.shape
    if slot_mapping.shape != (tokens,) or v.shape != k.shape or k_cache.shape[1:] != k.shape[1:] or v_cache.shape[1:] != k.shape[1:]:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slot_mapping.shape)} do not "
                         f"fit caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k, v and the caches must be contiguous in their last dim")
    if tokens:
        _kv_write_kernel[(tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            num_kv_heads, head_dim,
            HEADS_PAD=max(2, triton.next_power_of_2(num_kv_heads)),
            DIM_PAD=max(2, triton.next_power_of_2(head_dim)), FP8_CACHE=is_fp8(k_cache.dtype), num_warps=4,
            USE_PDL=pdl_enabled(), **pdl_launch(),
        )
