"""How K and V are stored in the paged cache (`kv_cache_dtype`), and the casts into and out of it.

"auto" keeps K/V in the model's dtype. "fp8" (vLLM's name, also "fp8_e4m3") stores them as
float8 e4m3 (torch.float8_e4m3fn): half the bytes of bf16, so the pool holds twice the tokens and
a decode step reads half the bytes. The scale is 1.0, as vLLM's is when a checkpoint brings no
calibrated one: a value is rounded to e4m3's 3-bit mantissa (relative error at most 2**-4) and
clamped to its range, +-448.

Invariant: attention always sees K/V as the cache holds them. The reference path reads every key
from the cache; the fast path's fresh prefill chunks attend over the step's own k/v instead, so the
Triton write kernels round those in place to the cached values (layers/fused/rotary.py,
kv_write.py). Both paths therefore compute the same thing, and their greedy tokens can be compared.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0   # torch.finfo(torch.float8_e4m3fn).max


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for CacheConfig.kv_cache_dtype (validated there)."""
    return model_dtype if kv_cache_dtype == "auto" else FP8_DTYPE


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: clamped into e4m3's range first (a value past 448 saturates
    rather than depending on how a cast treats overflow)."""
    if x.dtype == dtype:
        return x
    if is_fp8(dtype):
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def write_cache_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots[t]] = x[t], cast to the cache's dtype. An fp8 cache is written through a byte
    view: index_copy_ has no float8 kernel on the CPU."""
    x = to_cache_dtype(x, cache.dtype)
    if is_fp8(cache.dtype):
        cache.view(torch.uint8).index_copy_(0, slots, x.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, x)


def read_cache_rows(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[index] in `dtype` (the model's): what attention computes with."""
    rows = cache[index]
    return rows if rows.dtype == dtype else rows.to(dtype)
