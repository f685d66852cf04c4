"""The MoE's dispatch and combine around its grouped products, in two Triton kernels (V4's Triton
path, decode-sized steps).

RoutedExperts.forward_grouped sorts the step's (token, pick) pairs by expert, counts each
expert's rows, derives the tiles of the FP4 kernel (or the offsets of the bf16 grouped GEMM),
gathers the rows, and after the products weights each row and adds it to its token. In PyTorch
that is about fifteen small kernels a layer (a radix sort, index_add_, scans, divisions, fills,
index_add_ again) around the two products: at batch 1 more launches than work. Here:

  align     one program: each expert's count, first and end row and cumulative tile count, and
            for each pair its row in expert order (`pos`: the stable order, the reference's
            argsort), and for each row its token. Pairs are compared in chunks against the
            experts (counts) and against the earlier pairs (a pair's rank among its expert's).
  combine   one program per token and hidden block: the sum over the token's k rows of row *
            weight (each product rounded to the rows' dtype, as the reference's, then summed in
            float32), written once.

Meant for decode-sized steps (moe.FUSED_DISPATCH_PAIRS pairs at most: align holds every pair in
one program, and compares each with every earlier one); a prefill keeps the PyTorch path, whose
sort and gather scale. Nothing reads the host, so both fit a CUDA graph. References: forward_grouped's
PyTorch ops; tests/models/test_v4_fused.py compares them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Pairs compared at once against the experts and the earlier pairs (bounds the registers).
CHUNK = 32


class Dispatch(NamedTuple):
    """Where each (token, pick) pair goes, and the experts' rows and tiles (fp4_moe_triton's
    ExpertTiles: starts, ends, tile_ends)."""
    pos: torch.Tensor          # [pairs] int64: the pair's row in expert order
    token: torch.Tensor        # [pairs] int64: the token of each row in expert order
    counts: torch.Tensor       # [experts] int64
    starts: torch.Tensor       # [experts] int32
    ends: torch.Tensor         # [experts] int32
    tile_ends: torch.Tensor    # [experts] int32: cumulative BLOCK_M-row tiles


@triton.jit
def _align_kernel(ids_ptr, pos_ptr, token_ptr, counts_ptr, starts_ptr, ends_ptr, tile_ends_ptr, pairs, experts,
                  K: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr,
                  CHUNK: tl.constexpr):
    p = tl.arange(0, PAIRS)
    e = tl.arange(0, EXPERTS)
    ids = tl.load(ids_ptr + p, mask=p < pairs, other=-1).to(tl.int32)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    rank = tl.zeros((PAIRS,), dtype=tl.int32)       # earlier pairs with the same expert
    for c in tl.static_range(0, PAIRS, CHUNK):
        q = c + tl.arange(0, CHUNK)
        idq = tl.load(ids_ptr + q, mask=q < pairs, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == idq[None, :]).to(tl.int32), axis=1)
        earlier = (ids[:, None] == idq[None, :]) & (q[None, :] < p[:, None])
        rank += tl.sum(earlier.to(tl.int32), axis=1)
    ends = tl.cumsum(counts, axis=0)
    starts = ends - counts
    ok_e = e < experts
    tl.store(counts_ptr + e, counts.to(tl.int64), mask=ok_e)
    tl.store(starts_ptr + e, starts, mask=ok_e)
    tl.store(ends_ptr + e, ends, mask=ok_e)
    tl.store(tile_ends_ptr + e, tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, axis=0), mask=ok_e)
    # A pair's expert's first row, read back from the stores above (a barrier makes every
    # thread's stores visible to the program's other threads).
    tl.debug_barrier()
    ok_p = p < pairs
    pos = tl.load(starts_ptr + ids, mask=ok_p, other=0) + rank
    tl.store(pos_ptr + p, pos.to(tl.int64), mask=ok_p)
    tl.store(token_ptr + pos, (p // K).to(tl.int64), mask=ok_p)


@triton.jit
def _combine_kernel(rows_ptr, pos_ptr, weights_ptr, out_ptr, hidden, stride_rows, stride_out,
                    K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    kind = rows_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(pos_ptr + t * K + j)
        w = tl.load(weights_ptr + t * K + j).to(kind).to(tl.float32)
        y = tl.load(rows_ptr + row * stride_rows + cols, mask=ok, other=0.0).to(tl.float32)
        acc += (y * w).to(kind).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def align(ids: torch.Tensor, experts: int, block_m: int) -> Dispatch:
    """ids [T, k] (each token's experts, local ids) -> Dispatch: the rows sorted stably by expert
    (as torch.argsort(stable=True) of the flat ids), tiles of block_m rows."""
    tokens, k = ids.shape
    pairs = tokens * k
    device = ids.device
    out = Dispatch(torch.empty(pairs, dtype=torch.int64, device=device), torch.empty(pairs, dtype=torch.int64, device=device),
                   torch.empty(experts, dtype=torch.int64, device=device),
                   *(torch.empty(experts, dtype=torch.int32, device=device) for _ in range(3)))
    if pairs:
        padded = max(CHUNK, triton.next_power_of_2(pairs))
        _align_kernel[(1,)](ids.contiguous(), *out, pairs, experts, K=k, BLOCK_M=block_m, PAIRS=padded,
                            EXPERTS=triton.next_power_of_2(experts), CHUNK=CHUNK, num_warps=8)
    return out


def combine(rows: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [T * k, hidden] in expert order, pos [T * k] (each pair's row), weights [T, k] ->
    [T, hidden] in `dtype`: each token's rows times their weights, summed."""
    tokens, k = weights.shape
    hidden = rows.shape[1]
    out = torch.empty(tokens, hidden, dtype=dtype, device=rows.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(hidden))
        _combine_kernel[(tokens, triton.cdiv(hidden, block))](rows, pos, weights.contiguous(), out, hidden,
                                                              rows.stride(0), out.stride(0), K=k, BLOCK=block)
    return out
