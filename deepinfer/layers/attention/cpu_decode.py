"""Decode attention on the CPU: every decode row of the step in one gather and two batched matmuls.

The reference (Attention._decode) gathers K and V token-major, [B, L, kv_heads, D], then asks
matmul for [B, kv_heads, D, L]: a permuted view that matmul copies before multiplying, and a
float32 copy on top. At 32 rows those copies were most of the layer's attention time on the CPU
(docs/benchmarks/design-measurements.md#cpu-decode-gather).
Here the CPU backend (backends/cpu.py) precomputes, once per step, a head-major row index
(GatherGroupMetadata.decode_head_rows), so one index_select per cache yields K and V as
[B * kv_heads, L, D], contiguous: the layout torch.bmm takes as it is, with the G query heads
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


def cpu_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         head_rows: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q: [B, H, D]; caches: [rows, kv_heads, D]; head_rows: [B * kv_heads * L] (see
    GatherGroupMetadata.decode_head_rows); bias: [B, 1, 1, L] or None -> [B, H, D] in q's dtype."""
    threads = torch.get_num_threads()
    if q.shape[0] > SINGLE_THREAD_MAX_ROWS or threads == 1:
        return _attend(q, k_cache, v_cache, head_rows, bias, scale)
    torch.set_num_threads(1)
    try:
        return _attend(q, k_cache, v_cache, head_rows, bias, scale)
    finally:
        torch.set_num_threads(threads)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, head_rows: torch.Tensor,
            bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    length = head_rows.shape[0] // (batch * kv_heads)
    compute = torch.float32 if batch <= FP32_MAX_ROWS else q.dtype   # an fp8 cache is read in q's dtype
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
