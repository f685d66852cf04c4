"""DeepSeek-V4 sparse gather-attention in Triton: each query token attends to its raw window rows
and its compressed rows, read straight from the KV pages by index, plus a per-head sink.

MQA: every query head attends to the same keys (one K=V head of width D), so a program takes
one token and a block of HEADS_BLOCK heads, and each key tile [BLOCK_N, D] it loads serves all
of them in one tl.dot ([heads, D] x [D, keys]). Keys of token t at position p (chunk c):

  window       positions lo_t .. p, lo_t = max(p - window + 1, window floor, 0), read from the
               window pages: row = window_table[c, pos // block_size] * block_size + pos % block_size
  compressed   CSA (SELECT): the indexer's picks, row numbers in topk[t, :] padded with -1;
               HCA (ALL): rows 0 .. (p + 1) // rate - 1, every complete one
               Row b of chunk c lives in a page (b < first_new[c]: rows before the chunk, or
               written before) or in this step's new rows (b >= first_new[c]: new_rows[new_off[c]
               + b - first_new[c]]), exactly what the reference attends (a replayed chunk's
               recomputed rows below its write floor are not in the pages, only in new_rows).
               Page row of b: comp_table[c, b // per_page] * page_rows + b % per_page, page_rows =
               per_page + tail (the overlap tail rows sit after a page's rows).
  sink         s_h joins the softmax with a zero value: the running state starts as if the sink
               were the first key (max = s_h, sum = 1, acc = 0), and is then just dropped.

A small grid (decode at small batch: a program per 16 heads of a token) splits each token's key
tiles among SPLITS programs, tile s, s + SPLITS, ...; each writes its running state (max, sum,
unnormalised output; the sink only in split 0) and a second kernel merges them.

Softmax online in float32, base 2 (log2 e folded into the scale and the sink). float32 inputs
use IEEE products (not TF32), as the repo's other kernels do for the float32 parity tests.
Everything that changes per step (table widths, offsets) is a runtime argument: no recompile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def load_compressed(b, ok, dims, dim_ok, table_row_ptr, cache_ptr, stride_cr, new_ptr, stride_nr,
                    first_new, new_off, PER_PAGE: tl.constexpr, PAGE_ROWS: tl.constexpr):
    """Rows b [N] (where ok) of one chunk's compressed keys as a [N, DIM_PAD] tile: from the pages
    below first_new, from the step's new rows from there on (two masked loads; a masked-off load
    reads no memory)."""
    old = ok & (b < first_new)
    new = ok & (b >= first_new)
    page = tl.load(table_row_ptr + b // PER_PAGE, mask=old, other=0)
    rows = page.to(tl.int64) * PAGE_ROWS + b % PER_PAGE
    k_old = tl.load(cache_ptr + rows[:, None] * stride_cr + dims[None, :], mask=old[:, None] & dim_ok[None, :],
                    other=0.0)
    new_rows = (new_off + b - first_new).to(tl.int64)
    k_new = tl.load(new_ptr + new_rows[:, None] * stride_nr + dims[None, :], mask=new[:, None] & dim_ok[None, :],
                    other=0.0)
    return tl.where(new[:, None], k_new, k_old)


@triton.jit
def _fold(acc, l_i, m_i, q, k, ok, qk_scale, IEEE: tl.constexpr):
    """Fold one key tile (V = K) into the running softmax of a block of heads."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))      # finite: the state starts at the sink
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["stride_wt", "stride_ct", "stride_kt", "num_heads", "topk"],
            do_not_specialize_on_alignment=["tok_chunk_ptr", "tok_pos_ptr", "tok_lo_ptr", "win_table_ptr",
                                            "comp_table_ptr", "topk_ptr", "first_new_ptr", "new_off_ptr"])
def _sparse_attention_kernel(
    q_ptr, out_ptr, sinks_ptr, tok_chunk_ptr, tok_pos_ptr, tok_lo_ptr,
    win_cache_ptr, win_table_ptr, comp_cache_ptr, comp_table_ptr, new_ptr, first_new_ptr, new_off_ptr, topk_ptr,
    qk_scale, num_heads, topk,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_wr, stride_wt, stride_cr, stride_ct, stride_nr, stride_kt,
    part_ptr, stat_ptr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, HEADS_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr, RATE: tl.constexpr, PER_PAGE: tl.constexpr,
    PAGE_ROWS: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr,
):
    t = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    head_ok = heads < num_heads
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    chunk = tl.load(tok_chunk_ptr + t)
    pos = tl.load(tok_pos_ptr + t)
    lo = tl.load(tok_lo_ptr + t)

    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    # The sink as the first "key", with value 0 (module docstring), in split 0; the other splits
    # start empty (a very negative finite max, so a tile of masked keys changes nothing).
    m_i = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.full([HEADS_BLOCK], 1.0, tl.float32)
    if SPLITS > 1:
        m_i = tl.where(split == 0, m_i, -1.0e30)
        l_i = tl.where(split == 0, l_i, 0.0)
    acc = tl.zeros([HEADS_BLOCK, DIM_PAD], tl.float32)

    # Split s takes key tiles s, s + SPLITS, ... of the window, then of the compressed rows.
    win_row = win_table_ptr + chunk.to(tl.int64) * stride_wt
    for n in range(lo + split * BLOCK_N, pos + 1, SPLITS * BLOCK_N):
        kp = n + tl.arange(0, BLOCK_N)
        ok = kp <= pos
        block = tl.load(win_row + kp // BLOCK_SIZE, mask=ok, other=0)
        rows = block.to(tl.int64) * BLOCK_SIZE + kp % BLOCK_SIZE
        k = tl.load(win_cache_ptr + rows[:, None] * stride_wr + dims[None, :], mask=ok[:, None] & dim_ok[None, :],
                    other=0.0).to(q.dtype)
        acc, l_i, m_i = _fold(acc, l_i, m_i, q, k, ok, qk_scale, IEEE)

    if MODE > 0:
        comp_row = comp_table_ptr + chunk.to(tl.int64) * stride_ct
        first_new = tl.load(first_new_ptr + chunk)
        new_off = tl.load(new_off_ptr + chunk)
        if MODE == 1:   # CSA: the indexer's picks, -1 padded
            count = topk
        else:           # HCA: every complete row
            count = (pos + 1) // RATE
        for j in range(split * BLOCK_N, count, SPLITS * BLOCK_N):
            idx = j + tl.arange(0, BLOCK_N)
            if MODE == 1:
                b = tl.load(topk_ptr + t.to(tl.int64) * stride_kt + idx, mask=idx < count, other=-1)
                ok = b >= 0
            else:
                b = idx
                ok = idx < count
            k = load_compressed(b, ok, dims, dim_ok, comp_row, comp_cache_ptr, stride_cr, new_ptr, stride_nr,
                                first_new, new_off, PER_PAGE, PAGE_ROWS).to(q.dtype)
            acc, l_i, m_i = _fold(acc, l_i, m_i, q, k, ok, qk_scale, IEEE)

    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
    else:   # this split's running state, merged by _combine_splits_kernel
        row = (t.to(tl.int64) * SPLITS + split) * num_heads + heads
        tl.store(part_ptr + row[:, None] * DIM_PAD + dims[None, :], acc, mask=head_ok[:, None])
        tl.store(stat_ptr + 2 * row, m_i, mask=head_ok)
        tl.store(stat_ptr + 2 * row + 1, l_i, mask=head_ok)


@triton.jit
def _combine_splits_kernel(part_ptr, stat_ptr, out_ptr, num_heads, stride_ot, stride_oh,
                           HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr,
                           S_PAD: tl.constexpr):
    """One (token, head): the splits' states merged, each scaled by 2^(its max - the max)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_ok = s < SPLITS
    dims = tl.arange(0, DIM_PAD)
    row = (t * SPLITS + s) * num_heads + h
    m = tl.load(stat_ptr + 2 * row, mask=s_ok, other=-1.0e30)
    total = tl.load(stat_ptr + 2 * row + 1, mask=s_ok, other=0.0)
    weight = tl.math.exp2(m - tl.max(m, axis=0))
    acc = tl.load(part_ptr + row[:, None] * DIM_PAD + dims[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


# A split over the keys when the grid is small (decode at small batch): at most MAX_SPLITS, aiming
# at TARGET_PROGRAMS programs in all.
MAX_SPLITS = 16
TARGET_PROGRAMS = 256


def key_splits(tokens: int, head_blocks: int) -> int:
    """How many splits of each token's keys: 1 once tokens x head blocks fill the GPU."""
    return max(1, min(MAX_SPLITS, TARGET_PROGRAMS // max(1, tokens * head_blocks)))


def sparse_attention(q: torch.Tensor, sinks: torch.Tensor, tok_chunk: torch.Tensor, tok_pos: torch.Tensor,
                     tok_lo: torch.Tensor, win_cache: torch.Tensor, win_table: torch.Tensor, block_size: int,
                     comp: dict | None = None, topk: torch.Tensor | None = None,
                     heads_block: int = 16, block_n: int = 32, num_warps: int = 4,
                     num_stages: int = 2, splits: int | None = None) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, D] (q's dtype). Window rows from `win_cache` ([rows, D] or
    [rows, 1, D]) through `win_table` [chunks, blocks] int32; tok_* [T] int32: each token's
    chunk, position and window low bound. `comp` (None: sliding layer only) describes the
    compressed keys: cache, table, new_rows [N, D], first_new [chunks], new_off [chunks] (int32),
    rate, per_page, page_rows; with `topk` [T, k] int32 (-1 padded) the token attends those rows
    (CSA), without it every complete row (HCA). `splits` (None: key_splits, from the shapes
    alone) divides each token's key tiles among that many programs, merged by a second kernel:
    at batch 1 the grid is otherwise a program per 16 heads."""
    tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    win = win_cache.reshape(win_cache.shape[0], -1)
    if comp is None:
        mode, c_cache, c_table, new, first_new, new_off = 0, win, win_table, win, tok_chunk, tok_chunk
        rate, per_page, page_rows = 1, 1, 1
    else:
        mode = 1 if topk is not None else 2
        c_cache = comp["cache"].reshape(comp["cache"].shape[0], -1)
        c_table, new, first_new, new_off = comp["table"], comp["new_rows"], comp["first_new"], comp["new_off"]
        rate, per_page, page_rows = comp["rate"], comp["per_page"], comp["page_rows"]
    picks = topk if topk is not None else tok_chunk.view(-1, 1)
    head_blocks = triton.cdiv(num_heads, heads_block)
    splits = splits or key_splits(tokens, head_blocks)
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    if splits > 1:
        part = torch.empty(tokens * splits * num_heads, dim_pad, dtype=torch.float32, device=q.device)
        stat = torch.empty(tokens * splits * num_heads, 2, dtype=torch.float32, device=q.device)
    else:
        part = stat = out
    grid = (tokens, head_blocks, splits)
    _sparse_attention_kernel[grid](
        q, out, sinks, tok_chunk, tok_pos, tok_lo, win, win_table, c_cache, c_table, new, first_new, new_off, picks,
        head_dim ** -0.5 * LOG2E, num_heads, picks.shape[1] if topk is not None else 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), win.stride(0), win_table.stride(0),
        c_cache.stride(0), c_table.stride(0), new.stride(0), picks.stride(0), part, stat,
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, HEADS_BLOCK=heads_block, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, MODE=mode, RATE=rate, PER_PAGE=per_page, PAGE_ROWS=page_rows,
        IEEE=q.dtype == torch.float32, SPLITS=splits, num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _combine_splits_kernel[(tokens, num_heads)](part, stat, out, num_heads, out.stride(0), out.stride(1),
                                                    HEAD_DIM=head_dim, DIM_PAD=dim_pad, SPLITS=splits,
                                                    S_PAD=triton.next_power_of_2(splits))
    return out
