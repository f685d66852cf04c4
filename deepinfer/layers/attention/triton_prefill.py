"""Paged prefill / extend attention in Triton: variable-length query chunks over cached blocks.

Each sequence contributes `q_len` query tokens (rows `query_start[s]:query_start[s + 1]` of q)
that sit at the end of its `seq_lens[s]` KV positions: the first `seq_lens[s] - q_len` are a
cached prefix (prefix-cache hit, or earlier chunks of a chunked prefill) and the chunk's own K/V
are already written to the paged cache. So every key is read through the block table, and one
kernel covers a fresh prompt, a chunk on top of a prefix, and a sliding window.

One program per (query tile, sequence, query head), flash-attention style (online softmax in
fp32). The key range of a tile is cut to what its causal mask and window can see, so a causal
prefill does about half the work of a full one and a windowed one only its window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
    scale,
    stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len                       # cached positions before this chunk

    m_offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m_offs < q_len
    q_pos = context + m_offs                        # absolute position of each query
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + m_offs)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=m_ok[:, None] & dim_ok[None, :], other=0.0)

    # Keys this tile can see: causal up to its last query, and inside the window of its first.
    first_q = context + tile * BLOCK_M
    hi = tl.minimum(first_q + BLOCK_M, seq_len)
    lo = 0
    if WINDOW > 0:   # a constexpr: one compiled kernel per window size
        lo = (tl.maximum(first_q - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    for n in range(lo, hi, BLOCK_N):
        k_pos = n + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        block = tl.load(block_table_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        rows = block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
        k = tl.load(k_cache_ptr + rows[:, None] * stride_kr + kv_head * stride_kh + dims[None, :],
                    mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        if IEEE:   # float32 caches: exact products, not TF32 (parity tests run in float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows that saw nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + rows[:, None] * stride_vr + kv_head * stride_vh + dims[None, :],
                    mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m_offs)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                            max_query_len: int, scale: float, window: int | None, block_size: int,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] (the chunks back to back) -> [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // k_cache.shape[1]
    dim_pad = triton.next_power_of_2(head_dim)
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    block_m = 128 if dim_pad <= 128 else 64
    block_n = 64 if dim_pad <= 128 else 32
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_table, seq_lens, query_start, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, WINDOW=window or 0, IEEE=k_cache.dtype == torch.float32, num_warps=8, num_stages=2,
    )
    return out
