"""step_compressor.compress_step's three parts in three Triton kernels (V4's Triton path).

In PyTorch a compressor's step is some ninety small kernels (the sources' gathers, the slots'
concatenations, the softmax, the norm, the rope and the index arithmetic of each write), more
than any other part of a V4 decode step. Here, per compressor and step:

  pool   one program a row that may complete a block: the block's slots gathered from the step's
         projections or the request's ring, gates plus position_bias, a softmax over the slots
         per channel (online, SPAN slots in BLOCK_S chunks), the weighted sum, kv_norm and the
         rope at b * rate; written to its page where the reference writes it and returned as
         one of the step's new rows;
  tails  (overlapping compressors) one program a row that may end a KV block: the block's last
         Ca (kv and gate, first halves) into the page's tail rows;
  ring   one program a token: its projections into its request's ring row, once pool and tails
         have read the ring (the stream orders the launches).
A program whose row does nothing (no block completed, below the write floor) writes nothing where
the reference writes into the null block (nor its output row: only a CUDA graph's rows, all of
them, include such rows, and a graph step reads every compressed row from the pages); everything
else is the reference's arithmetic in float32, rounded where the reference rounds (its pooled sum,
its norm). The channels are read as even and odd halves so that the rope's pairs are in registers
without a shuffle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _source(step_ptr, ring_ptr, q, in_step, step_row, ring_row, cols, stride, ok):
    """Channels `cols` ([S, C] or [1, C]) of positions q [S], as an [S, C] float32 tile: the step's
    row where in_step, else the ring's."""
    from_step = tl.load(step_ptr + step_row[:, None] * stride + cols, mask=ok & in_step[:, None], other=0.0)
    from_ring = tl.load(ring_ptr + ring_row[:, None] * stride + cols, mask=ok & ~in_step[:, None], other=0.0)
    return tl.where(in_step[:, None], from_step, from_ring).to(tl.float32)


@triton.jit
def _where_held(q, seg_start, seg_row, slot, length, num_tokens):
    """Positions q of a request: (in this step, the step's row, the ring's row), each as q."""
    in_step = q >= seg_start
    step_row = tl.minimum(tl.maximum(seg_row + q - seg_start, 0), num_tokens - 1)
    return in_step, step_row, slot * length + tl.maximum(q, 0) % length


@triton.jit
def _slots(kv_ptr, gate_ptr, ring_kv_ptr, ring_gate_ptr, bias_ptr, q, in_step, step_row, ring_row, cols, bias_row,
           width, ok, dead):
    """A chunk of a block's slots at channels `cols`: (kv, gate + position_bias; dead slots -1e30)."""
    kv = _source(kv_ptr, ring_kv_ptr, q, in_step, step_row, ring_row, cols, width, ok)
    g = _source(gate_ptr, ring_gate_ptr, q, in_step, step_row, ring_row, cols, width, ok)
    g = g + tl.load(bias_ptr + bias_row + cols, mask=ok, other=0.0)
    return kv, tl.where(dead, -1.0e30, g)


@triton.jit
def _online_pool(m, total, acc, kv, g):
    """One chunk of slots [S, C] into the running per-channel softmax (max m, sum of weights
    total) and weighted sum acc."""
    m_new = tl.maximum(m, tl.max(g, axis=0))
    alpha = tl.exp(m - m_new)
    w = tl.exp(g - m_new[None, :])
    return m_new, total * alpha + tl.sum(w, axis=0), acc * alpha + tl.sum(w * kv, axis=0)


@triton.jit
def _pool_kernel(rows_ptr, pos_ptr, seg_start_ptr, seg_row_ptr, slot_ptr, chunk_ptr, write_floor_ptr,
                 kv_ptr, gate_ptr, ring_kv_ptr, ring_gate_ptr, bias_ptr, norm_w_ptr, cos_ptr, sin_ptr,
                 table_ptr, cache_ptr, out_ptr,
                 num_tokens, width, length, table_width, stride_table, stride_cache, page_rows, per_page, eps,
                 RATE: tl.constexpr, SPAN: tl.constexpr, D: tl.constexpr, HALF_PAD: tl.constexpr,
                 ROPE_HALF: tl.constexpr, BLOCK_S: tl.constexpr):
    i = tl.program_id(0)
    r = tl.load(rows_ptr + i).to(tl.int64)
    p = tl.load(pos_ptr + r).to(tl.int64)
    if (p + 1) % RATE != 0:
        # Completes no block: nothing to write. Only a CUDA graph's rows (every row) come here,
        # and a graph's attention reads every compressed row from the pages, not this output.
        return
    block = p // RATE
    seg_start = tl.load(seg_start_ptr + r)
    seg_row = tl.load(seg_row_ptr + r)
    slot = tl.load(slot_ptr + r)
    pair = tl.arange(0, HALF_PAD)
    pair_ok = pair < D // 2
    first = block * RATE - (SPAN - RATE)   # overlap (SPAN = 2 RATE): from the block before
    m_even = tl.full((HALF_PAD,), -1.0e30, tl.float32)
    m_odd = tl.full((HALF_PAD,), -1.0e30, tl.float32)
    l_even = tl.zeros((HALF_PAD,), tl.float32)
    l_odd = tl.zeros((HALF_PAD,), tl.float32)
    acc_even = tl.zeros((HALF_PAD,), tl.float32)
    acc_odd = tl.zeros((HALF_PAD,), tl.float32)
    for s0 in range(0, SPAN, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < SPAN
        q = first + s
        # Overlap: slots < RATE are Ca (first D channels) of the block before, the rest Cb; no
        # overlap: every slot's D channels.
        half_off = tl.where(s >= RATE, D, 0)
        in_step, step_row, ring_row = _where_held(q, seg_start, seg_row, slot, length, num_tokens)
        cols_even = half_off[:, None] + 2 * pair[None, :]
        ok = s_ok[:, None] & pair_ok[None, :]
        bias_row = (s % RATE)[:, None] * width
        dead = ~s_ok[:, None]
        if SPAN > RATE:
            dead = dead | ((s < RATE) & (block == 0))[:, None]   # block 0 has no Ca
        kv, g = _slots(kv_ptr, gate_ptr, ring_kv_ptr, ring_gate_ptr, bias_ptr, q, in_step, step_row, ring_row,
                       cols_even, bias_row, width, ok, dead)
        m_even, l_even, acc_even = _online_pool(m_even, l_even, acc_even, kv, g)
        kv, g = _slots(kv_ptr, gate_ptr, ring_kv_ptr, ring_gate_ptr, bias_ptr, q, in_step, step_row, ring_row,
                       cols_even + 1, bias_row, width, ok, dead)
        m_odd, l_odd, acc_odd = _online_pool(m_odd, l_odd, acc_odd, kv, g)
    kind = out_ptr.dtype.element_ty
    # The pooled row rounded as the reference's sum is, then kv_norm (float32, rounded once).
    even = (acc_even / l_even).to(kind).to(tl.float32)
    odd = (acc_odd / l_odd).to(kind).to(tl.float32)
    even = tl.where(pair_ok, even, 0.0)
    odd = tl.where(pair_ok, odd, 0.0)
    rstd = tl.rsqrt((tl.sum(even * even, axis=0) + tl.sum(odd * odd, axis=0)) / D + eps)
    even = (tl.load(norm_w_ptr + 2 * pair, mask=pair_ok, other=0.0) * (even * rstd)).to(kind).to(tl.float32)
    odd = (tl.load(norm_w_ptr + 2 * pair + 1, mask=pair_ok, other=0.0) * (odd * rstd)).to(kind).to(tl.float32)
    # The rope on the last ROPE_HALF pairs, at the block's first position.
    turn = pair - (D // 2 - ROPE_HALF)
    turned = (turn >= 0) & pair_ok
    cos = tl.load(cos_ptr + i * ROPE_HALF + turn, mask=turned, other=1.0)
    sin = tl.load(sin_ptr + i * ROPE_HALF + turn, mask=turned, other=0.0)
    even, odd = even * cos - odd * sin, odd * cos + even * sin
    tl.store(out_ptr + i * D + 2 * pair, even.to(kind), mask=pair_ok)
    tl.store(out_ptr + i * D + 2 * pair + 1, odd.to(kind), mask=pair_ok)
    kept = (tl.load(write_floor_ptr + r) + RATE - 1) // RATE
    if block >= kept:
        page = tl.minimum(block // per_page, table_width - 1)
        target = tl.load(table_ptr + tl.load(chunk_ptr + r).to(tl.int64) * stride_table + page).to(tl.int64)
        dst = cache_ptr + (target * page_rows + block % per_page) * stride_cache
        tl.store(dst + 2 * pair, even.to(cache_ptr.dtype.element_ty), mask=pair_ok)
        tl.store(dst + 2 * pair + 1, odd.to(cache_ptr.dtype.element_ty), mask=pair_ok)


@triton.jit
def _tails_kernel(rows_ptr, pos_ptr, seg_start_ptr, seg_row_ptr, slot_ptr, chunk_ptr, write_floor_ptr,
                  kv_ptr, gate_ptr, ring_kv_ptr, ring_gate_ptr, table_ptr, cache_ptr,
                  num_tokens, width, length, table_width, stride_table, stride_cache, page_rows, per_page, block_size,
                  RATE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    r = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    p = tl.load(pos_ptr + r).to(tl.int64)
    if ((p + 1) % block_size == 0) & (p + 1 > tl.load(write_floor_ptr + r)):
        seg_start = tl.load(seg_start_ptr + r)
        s = tl.arange(0, RATE)
        q = p + 1 - RATE + s
        in_step, step_row, ring_row = _where_held(q, seg_start, tl.load(seg_row_ptr + r), tl.load(slot_ptr + r),
                                                  length, num_tokens)
        cols = tl.arange(0, D_PAD)
        ok = (cols < D)[None, :]
        kv = _source(kv_ptr, ring_kv_ptr, q, in_step, step_row, ring_row, cols[None, :], width, ok)
        gate = _source(gate_ptr, ring_gate_ptr, q, in_step, step_row, ring_row, cols[None, :], width, ok)
        page = tl.minimum(p // block_size, table_width - 1)
        target = tl.load(table_ptr + tl.load(chunk_ptr + r).to(tl.int64) * stride_table + page).to(tl.int64)
        first = target * page_rows + per_page
        kind = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + (first + s[:, None]) * stride_cache + cols[None, :], kv.to(kind), mask=ok)
        tl.store(cache_ptr + (first + RATE + s[:, None]) * stride_cache + cols[None, :], gate.to(kind), mask=ok)


@triton.jit
def _ring_kernel(pos_ptr, slot_ptr, seg_end_ptr, kv_ptr, gate_ptr, ring_kv_ptr, ring_gate_ptr, width, length,
                 W_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    if p >= tl.load(seg_end_ptr + t) - length:   # the request's last `length` positions
        row = tl.load(slot_ptr + t) * length + p % length
        cols = tl.arange(0, W_PAD)
        ok = cols < width
        kv = tl.load(kv_ptr + t * width + cols, mask=ok)
        gate = tl.load(gate_ptr + t * width + cols, mask=ok)
        tl.store(ring_kv_ptr + row * width + cols, kv.to(ring_kv_ptr.dtype.element_ty), mask=ok)
        tl.store(ring_gate_ptr + row * width + cols, gate.to(ring_gate_ptr.dtype.element_ty), mask=ok)


def compress_step_fused(compressor, kv: torch.Tensor, gate: torch.Tensor, meta, ring_kv: torch.Tensor,
                        ring_gate: torch.Tensor, length: int, cache: torch.Tensor, table: torch.Tensor,
                        rows: torch.Tensor, tail_rows: torch.Tensor | None) -> torch.Tensor:
    """step_compressor.compress_step's pooling (rows: those that may complete a block), tails
    (tail_rows: those that may end a KV block; None without overlap) and ring writes for the
    step's projections kv, gate [T, width]; returns the pooled rows [len(rows), dim]."""
    rate, d = compressor.rate, compressor.dim
    bs = meta.block_size
    per_page = bs // rate
    page_rows = per_page + (2 * rate if compressor.overlap else 0)
    tokens, width = kv.shape
    rope_dim = compressor.rotary.rope_dim
    kv, gate = kv.contiguous(), gate.contiguous()
    cache_rows = cache.view(cache.shape[0] * cache.shape[1], -1) if cache.dim() == 3 else cache
    if cache.dim() == 3 and cache.shape[1] != 1:
        raise ValueError(f"a compressed cache of one row per slot, not {tuple(cache.shape)}")
    index = (meta.tok_pos, meta.seg_start, meta.seg_row, meta.tok_slot, meta.tok_chunk, meta.tok_write_floor)
    pooled = torch.empty(rows.shape[0], d, dtype=kv.dtype, device=kv.device)
    if rows.shape[0]:
        cos, sin = compressor.rotary.cos_sin(meta.tok_pos[rows] // rate * rate)
        _pool_kernel[(rows.shape[0],)](
            rows, *index, kv, gate, ring_kv, ring_gate, compressor.position_bias, compressor.kv_norm.weight,
            cos.contiguous(), sin.contiguous(), table, cache_rows, pooled,
            tokens, width, length, table.shape[1], table.stride(0), cache_rows.stride(0), page_rows, per_page,
            compressor.kv_norm.eps, RATE=rate, SPAN=2 * rate if compressor.overlap else rate, D=d,
            HALF_PAD=triton.next_power_of_2(d // 2), ROPE_HALF=rope_dim // 2, BLOCK_S=min(16, 2 * rate),
            num_warps=4 if d <= 256 else 8)
    if tail_rows is not None and tail_rows.shape[0]:
        _tails_kernel[(tail_rows.shape[0],)](
            tail_rows, *index, kv, gate, ring_kv, ring_gate, table, cache_rows,
            tokens, width, length, table.shape[1], table.stride(0), cache_rows.stride(0), page_rows, per_page, bs,
            RATE=rate, D=d, D_PAD=triton.next_power_of_2(d))
    if tokens:
        _ring_kernel[(tokens,)](meta.tok_pos, meta.tok_slot, meta.seg_end, kv, gate, ring_kv, ring_gate, width, length,
                                W_PAD=triton.next_power_of_2(width))
    return pooled
