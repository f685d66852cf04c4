"""Decode attention on the CPU: every decode row of the step in one gather and two batched matmuls.

The reference (Attention._decode) gathers K and V token-major, [B, L, kv_heads, D], then asks
matmul for [B, kv_heads, D, L]: a permuted view that matmul copies before multiplying, and a
float32 copy on top. At 32 rows those copies were most of the layer's attention time on the CPU
(docs/benchmarks/design-measurements.md#cpu-decode-gather).
Here the CPU backend (backends/cpu.py) precomputes, once per step, a head-major row index
(GatherGroupMetadata.decode_head_rows), so one index_select per cache (or one for both, where V
directly follows K in memory: kv_paired) yields K and V as [B * kv_heads, L, D], contiguous: the layout torch.bmm takes as it is, with the G query heads
that share a KV head as the rows of one small product. Rows shorter than the longest are padded
with the null block's row 0 and hidden by the same additive bias as the reference (0 / -inf,
[B, 1, 1, L]); a sliding window is already cut out by the gather, as in the reference.

Precision: up to FP32_MAX_ROWS rows the products run in float32 (exact softmax, and for a few
tiny matrices float32 GEMMs are faster than bf16 ones here); above, in the model's dtype, with
float32 accumulation inside the GEMM and the softmax computed in float32 internally. That is
what transformers' eager attention does for a bf16 model. Float32 models compute in float32
throughout. tests/unit/test_cpu_fast_path.py compares this with the reference.
"""

from __future__ import annotations

import torch

# A single decode row attends on one thread: its ops are so small that waking the other
# OpenMP thread for each of them costs more than it brings. From 4 rows on, two threads win
# again. Figures: docs/benchmarks/design-measurements.md#cpu-decode-threads
SINGLE_THREAD_MAX_ROWS = 1

# Up to this many decode rows the products run in float32 (see the module docstring): a SmolLM2
# decode forward was faster with float32 products up to 4 rows and with bf16 ones from 8 on.
# Figures: docs/benchmarks/design-measurements.md#cpu-decode-fp32-rows
FP32_MAX_ROWS = 4


def kv_paired(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether V's rows directly follow K's in one storage (KVLayout.allocate on the CPU), so that
    one index_select over both, as [2 * rows * kv_heads, D], reads K and V rows together."""
    return (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and k_cache.dtype == v_cache.dtype and k_cache.device == v_cache.device
            and k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()
            and v_cache.storage_offset() == k_cache.storage_offset() + k_cache.numel())


def cpu_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         head_rows: torch.Tensor, bias: torch.Tensor | None, scale: float,
                         paired: bool = False) -> torch.Tensor:
    """q: [B, H, D]; caches: [rows, kv_heads, D]; head_rows: [B * kv_heads * L] (see
    GatherGroupMetadata.decode_head_rows), or with `paired` (kv_paired holds) those rows and then
    the same rows of V, [2 * B * kv_heads * L]; bias: [B, 1, 1, L] or None -> [B, H, D] in q's dtype."""
    threads = torch.get_num_threads()
    if q.shape[0] > SINGLE_THREAD_MAX_ROWS or threads == 1:
        return _attend(q, k_cache, v_cache, head_rows, bias, scale, paired)
    torch.set_num_threads(1)
    try:
        return _attend(q, k_cache, v_cache, head_rows, bias, scale, paired)
    finally:
        torch.set_num_threads(threads)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, head_rows: torch.Tensor,
            bias: torch.Tensor | None, scale: float, paired: bool = False) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    compute = torch.float32 if batch <= FP32_MAX_ROWS else q.dtype   # an fp8 cache is read in q's dtype
    if paired:   # one gather and one conversion for K and V (two ops fewer a layer)
        length = head_rows.shape[0] // (2 * batch * kv_heads)
        both = k_cache.as_strided((2 * k_cache.shape[0] * kv_heads, dim), (dim, 1)).index_select(0, head_rows)
        if both.dtype != compute:
            both = both.to(compute)
        keys, values = both.view(2, batch * kv_heads, length, dim).unbind(0)
    else:
        length = head_rows.shape[0] // (batch * kv_heads)
        keys = k_cache.view(-1, dim).index_select(0, head_rows).view(batch * kv_heads, length, dim)
        values = v_cache.view(-1, dim).index_select(0, head_rows).view(batch * kv_heads, length, dim)
        if keys.dtype != compute:
            keys, values = keys.to(compute), values.to(compute)
    # The scale goes on q (one small tensor) rather than on the scores; the product also makes
    # q contiguous, which the view into [B * kv_heads, G, D] needs.
    scaled_q = (q.to(compute) * scale).view(batch * kv_heads, group, dim)
    scores = torch.bmm(scaled_q, keys.transpose(1, 2))                    # [B * kv_heads, G, L]
    if bias is not None:
        scores.view(batch, kv_heads, group, length).add_(bias)
    # In bf16, torch's CPU softmax accumulates in float32 and rounds once at the end.
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, values).view(batch, heads, dim)
    return out if out.dtype == q.dtype else out.to(q.dtype)
