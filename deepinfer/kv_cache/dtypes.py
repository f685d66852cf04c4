"""How K and V are stored in the paged cache (`kv_cache_dtype`), and the casts into and out of it.

"auto" keeps K/V in the model's dtype. "fp8" (vLLM's name, also "fp8_e4m3") stores them as
float8 e4m3 (torch.float8_e4m3fn): half the bytes of bf16, so the pool holds twice the tokens and
a decode step reads half the bytes. The scale is 1.0, as vLLM's is when a checkpoint brings no
calibrated one: a value is rounded to e4m3's 3-bit mantissa (relative error at most 2**-4) and
clamped to its range, +-448. "fp8_e5m2" stores float8 e5m2 (torch.float8_e5m2: a 2-bit mantissa,
range +-57344); the fused and Triton kernels read and write e4m3 only (`is_fp8`), so with it
attention runs on the reference backend (layers/attention/backends/selection.py).

Invariant: attention always sees K/V as the cache holds them. The reference path reads every key
from the cache; the fast path's fresh prefill chunks attend over the step's own k/v instead, so the
Triton write kernels round those in place to the cached values (layers/fused/rotary.py,
kv_write.py). Both paths therefore compute the same thing, and their greedy tokens can be compared.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0   # torch.finfo(torch.float8_e4m3fn).max
FP8_E5M2 = torch.float8_e5m2
FLOAT8_MAX = {FP8_DTYPE: FP8_MAX, FP8_E5M2: 57344.0}   # torch.finfo(...).max of each


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for CacheConfig.kv_cache_dtype (validated there)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return FP8_E5M2 if kv_cache_dtype == "fp8_e5m2" else FP8_DTYPE


def is_fp8(dtype: torch.dtype) -> bool:
    """float8 e4m3: the fp8 the kernels read and write."""
    return dtype == FP8_DTYPE


def is_float8(dtype: torch.dtype) -> bool:
    """Either float8 kind (e4m3 or e5m2)."""
    return dtype in FLOAT8_MAX


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: a float8 one clamped into its range first (a value past it
    saturates rather than depending on how a cast treats overflow)."""
    if x.dtype == dtype:
        return x
    if is_float8(dtype):
        return x.clamp(-FLOAT8_MAX[dtype], FLOAT8_MAX[dtype]).to(dtype)
    return x.to(dtype)


def write_cache_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots[t]] = x[t], cast to the cache's dtype. An fp8 cache is written through a byte
    view: index_copy_ has no float8 kernel on the CPU."""
    x = to_cache_dtype(x, cache.dtype)
    if is_float8(cache.dtype):
        cache.view(torch.uint8).index_copy_(0, slots, x.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, x)


def read_cache_rows(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[index] in `dtype` (the model's): what attention computes with."""
    rows = cache[index]
    return rows if rows.dtype == dtype else rows.to(dtype)
