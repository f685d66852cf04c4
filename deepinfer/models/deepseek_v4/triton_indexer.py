"""DeepSeek-V4's Lightning Indexer scoring in Triton, and the top-k selection on its scores.

    score(t, s) = sum_h w[t, h] * relu(qI[t, h] . K_I[s]) / sqrt(index_head_dim)

for the rows s complete at token t (s < (p_t + 1) // rate), -inf for the others. A program takes
one token and a tile of BLOCK_S rows: the token's [heads, dim] queries against the [BLOCK_S, dim]
key tile in one tl.dot, relu, weighted and summed over heads. The index keys are read from the
pages and this step's new rows exactly as triton_attention.load_compressed reads compressed rows.

The selection (`select_topk`) keeps the indexer's tie rule: a stable descending sort, so equal
scores go to the earlier row, whatever rows the step holds beyond (docs/deepseek_v4.md, "The
Lightning Indexer"). Each score depends only on (t, s) and the program's fixed tile shape, not
on how many rows or tokens the step has, so chunked and one-shot prefill score and pick alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.models.deepseek_v4.triton_attention import load_compressed


@triton.jit(do_not_specialize=["stride_ct", "stride_st", "num_heads"],
            do_not_specialize_on_alignment=["tok_chunk_ptr", "tok_pos_ptr", "comp_table_ptr", "first_new_ptr",
                                            "new_off_ptr"])
def _index_score_kernel(
    q_ptr, w_ptr, scores_ptr, tok_chunk_ptr, tok_pos_ptr, comp_cache_ptr, comp_table_ptr, new_ptr, first_new_ptr,
    new_off_ptr, scale, num_heads,
    stride_qt, stride_qh, stride_wt, stride_st, stride_cr, stride_ct, stride_nr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    RATE: tl.constexpr, PER_PAGE: tl.constexpr, PAGE_ROWS: tl.constexpr, IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    pos = tl.load(tok_pos_ptr + t)
    count = (pos + 1) // RATE                  # rows complete at this token
    ok = s < count
    out_ptrs = scores_ptr + t.to(tl.int64) * stride_st + s
    if tl.program_id(1) * BLOCK_S < count:
        chunk = tl.load(tok_chunk_ptr + t)
        heads = tl.arange(0, HEADS_PAD)
        head_ok = heads < num_heads
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
        w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
        first_new = tl.load(first_new_ptr + chunk)
        new_off = tl.load(new_off_ptr + chunk)
        k = load_compressed(s, ok, dims, dim_ok, comp_table_ptr + chunk.to(tl.int64) * stride_ct, comp_cache_ptr,
                            stride_cr, new_ptr, stride_nr, first_new, new_off, PER_PAGE, PAGE_ROWS).to(q.dtype)
        if IEEE:
            dots = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            dots = tl.dot(q, tl.trans(k))
        score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], 0) * scale
        tl.store(out_ptrs, tl.where(ok, score, float("-inf")))
    else:   # a tile past the token's complete rows: -inf, nothing read
        tl.store(out_ptrs, tl.full([BLOCK_S], float("-inf"), tl.float32))


def index_scores(q: torch.Tensor, weights: torch.Tensor, tok_chunk: torch.Tensor, tok_pos: torch.Tensor,
                 comp: dict, num_rows: int, block_s: int = 64, num_warps: int = 4) -> torch.Tensor:
    """q [T, heads, dim], weights [T, heads] (float32, with the 1/sqrt(heads) in them) -> scores
    [T, num_rows] float32, -inf where a row is not complete at the token. `comp` as in
    triton_attention.sparse_attention (the index keys' cache, table and new rows); num_rows at
    least every token's complete rows."""
    tokens, heads, dim = q.shape
    width = triton.cdiv(max(num_rows, 1), block_s) * block_s
    scores = torch.empty(tokens, width, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return scores[:, :num_rows]
    cache = comp["cache"].reshape(comp["cache"].shape[0], -1)
    new = comp["new_rows"]
    _index_score_kernel[(tokens, width // block_s)](
        q, weights, scores, tok_chunk, tok_pos, cache, comp["table"], new, comp["first_new"], comp["new_off"],
        dim ** -0.5, heads,
        q.stride(0), q.stride(1), weights.stride(0), scores.stride(0), cache.stride(0), comp["table"].stride(0),
        new.stride(0),
        HEAD_DIM=dim, DIM_PAD=max(16, triton.next_power_of_2(dim)), HEADS_PAD=max(16, triton.next_power_of_2(heads)),
        BLOCK_S=block_s, RATE=comp["rate"], PER_PAGE=comp["per_page"], PAGE_ROWS=comp["page_rows"],
        IEEE=q.dtype == torch.float32, num_warps=num_warps,
    )
    return scores[:, :num_rows]


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, rows] scores -> [T, k] int32 row numbers, best first, -1 where a token has fewer than
    k complete rows. A stable sort: ties go to the earlier row (the reference's rule, indexer.py);
    complete rows score finite, so the -inf ones come last and are dropped."""
    tokens, rows = scores.shape
    picks = torch.full((tokens, k), -1, dtype=torch.int32, device=scores.device)
    if rows == 0 or tokens == 0:
        return picks
    values, order = scores.sort(dim=-1, descending=True, stable=True)
    n = min(k, rows)
    picks[:, :n] = torch.where(values[:, :n] == float("-inf"), -1, order[:, :n]).to(torch.int32)
    return picks
