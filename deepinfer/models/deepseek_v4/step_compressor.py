"""A V4 compressor over every token of a step at once, on the device (the Triton path's,
paged_kernels.py): no loop over requests, and on a decode step no host work, so that a CUDA
graph replays it. Compressor.compress (compressor.py) is the reference it follows, op for op.

Each token t of the step is at position p of its request; its request's tokens in the step are
consecutive rows (a prefill chunk, or the decode rows of a chunk verifying drafts), the first at
position seg_start and row seg_row (V4KernelMetadata). The projections of a position q of that
request are this step's (row seg_row + q - seg_start) when q >= seg_start, else the ring's
(rings.py, the request's slot).

  1. kv, gate = kv_proj(x), gate_proj(x) for every token;
  2. a token that completes a block (p + 1 = (b + 1) * rate) pools it: the block's `rate`
     positions (overlapping blocks: Ca of the block before, then Cb of this one, 2 * rate slots;
     block 0 has no Ca: its gates are -inf), gates plus position_bias, softmax over the slots,
     the weighted sum, kv_norm, rope at b * rate. The row goes to its page (not below the write
     floor: SWA Bounded Replay keeps the cached rows) and to the kernels as one of the step's
     new rows;
  3. overlap: a token that ends a KV block saves the block's last Ca (kv and gate of its last
     rate positions, first halves, gate without position_bias) in the page's tail rows, which a
     request resuming at that block boundary reads (paged.py's layout);
  4. each request's last `length` positions go into its ring slot, after 2 and 3 read it.
Which tokens pool (2) and save tails (3): on an eager step the host lists them; in a CUDA graph
every row does, and the writes of the rows that should not go to the null block.
"""

from __future__ import annotations

import torch

from deepinfer.layers.attention.metadata import current_backend
from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.rings import ProjectionRings, ring_rows

# first_new of a graph step: every compressed row a token reads is in the pages by then.
ALL_IN_PAGES = 2 ** 30


def _sources(meta, rows: torch.Tensor, positions: torch.Tensor, step_kv: torch.Tensor, step_gate: torch.Tensor,
             ring_kv: torch.Tensor, ring_gate: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The projections of `positions` [C, S] of the requests of step rows `rows` [C]: (kv, gate)
    [C, S, width], from the step where the position is in it, else from the request's ring."""
    seg_start = meta.seg_start[rows][:, None]
    in_step = positions >= seg_start
    step_rows = (meta.seg_row[rows][:, None] + positions - seg_start).clamp(0, step_kv.shape[0] - 1)
    held = ring_rows(meta.tok_slot[rows][:, None], positions, length)
    pick = in_step[..., None]
    return (torch.where(pick, step_kv[step_rows], ring_kv[held]),
            torch.where(pick, step_gate[step_rows], ring_gate[held]))


def _page_rows(meta, table: torch.Tensor, rows: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
    """Each row's request's block id at page index `page` (clamped into the table: rows whose
    write is dropped may point past it)."""
    chunks = meta.tok_chunk[rows].long()
    return table[chunks, page.clamp(0, table.shape[1] - 1)].long()


def compress_step(compressor: Compressor, x: torch.Tensor, meta, rings: ProjectionRings, key, cache: torch.Tensor,
                  table: torch.Tensor) -> dict:
    """Run the compressor over the step (module docstring); returns the compressed keys as the
    kernels read them (triton_attention.sparse_attention's `comp`). Where the forward's backend
    turns on fused_v4_ops, parts 2-4 are three Triton kernels (triton_compressor.py) with
    _pool_tails_rings as their reference."""
    rate, d = compressor.rate, compressor.dim
    bs = meta.block_size
    per_page = bs // rate
    length = rings.length(key)
    ring_kv, ring_gate = rings.flat(key)
    kv, gate = compressor.kv_proj(x), compressor.gate_proj(x)
    rows = meta.pooling_rows(rate)
    if current_backend().fused_v4_ops:
        from deepinfer.models.deepseek_v4.triton_compressor import compress_step_fused

        pooled = compress_step_fused(compressor, kv, gate, meta, ring_kv, ring_gate, length, cache, table, rows,
                                     meta.tail_rows() if compressor.overlap else None)
    else:
        pooled = _pool_tails_rings(compressor, kv, gate, meta, rings.span(key), ring_kv, ring_gate, length, cache,
                                   table, rows)
    first_new, new_off = meta.new_row_starts(rate)
    return dict(cache=cache, table=table, new_rows=pooled.contiguous() if pooled.shape[0] else cache.new_zeros(1, d),
                first_new=first_new, new_off=new_off, rate=rate, per_page=per_page,
                page_rows=per_page + (2 * rate if compressor.overlap else 0), max_rows=meta.rows_bound(rate))


def _pool_tails_rings(compressor: Compressor, kv: torch.Tensor, gate: torch.Tensor, meta, span: int,
                      ring_kv: torch.Tensor, ring_gate: torch.Tensor, length: int, cache: torch.Tensor,
                      table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Parts 2-4 in PyTorch, for the step's projections kv, gate; returns the pooled rows."""
    rate, d, overlap = compressor.rate, compressor.dim, compressor.overlap
    bs = meta.block_size
    per_page = bs // rate
    tail = 2 * rate if overlap else 0
    page_rows = per_page + tail
    pos = meta.tok_pos.long()

    # 2. the blocks completed in the step
    p = pos[rows]
    block = p // rate
    positions = (block * rate - (rate if overlap else 0))[:, None] + torch.arange(span, device=kv.device)
    src_kv, src_gate = _sources(meta, rows, positions, kv, gate, ring_kv, ring_gate, length)
    if overlap:
        slots_kv = torch.cat([src_kv[:, :rate, :d], src_kv[:, rate:, d:]], dim=1)
        ca_gate = src_gate[:, :rate, :d] + compressor.position_bias[:, :d]
        ca_gate = ca_gate.masked_fill((block == 0)[:, None, None], float("-inf"))
        slots_gate = torch.cat([ca_gate, src_gate[:, rate:, d:] + compressor.position_bias[:, d:]], dim=1)
    else:
        slots_kv, slots_gate = src_kv, src_gate + compressor.position_bias
    weights = slots_gate.softmax(dim=1, dtype=torch.float32).to(slots_kv.dtype)
    pooled = compressor.kv_norm((slots_kv * weights).sum(dim=1))
    pooled = compressor.rotary.rotate(pooled[None, :, None], block * rate)[0, :, 0]     # [C, d]
    kept = (meta.tok_write_floor[rows] + rate - 1) // rate      # rows below stay as cached
    write = ((p + 1) % rate == 0) & (block >= kept)
    target = _page_rows(meta, table, rows, block // per_page) * page_rows + block % per_page
    cache[torch.where(write, target, 0), 0] = pooled.to(cache.dtype)

    # 3. the tails of the KV blocks completed in the step
    if overlap:
        rows_t = meta.tail_rows()
        p_t = pos[rows_t]
        ca_positions = (p_t + 1 - rate)[:, None] + torch.arange(rate, device=kv.device)
        ca_kv, ca_gate = _sources(meta, rows_t, ca_positions, kv, gate, ring_kv, ring_gate, length)
        saved = torch.cat([ca_kv[..., :d], ca_gate[..., :d]], dim=1).to(cache.dtype)    # [C, 2 * rate, d]
        save = ((p_t + 1) % bs == 0) & (p_t + 1 > meta.tok_write_floor[rows_t])
        first = _page_rows(meta, table, rows_t, p_t // bs) * page_rows + per_page
        first = torch.where(save, first, per_page)                  # the null block's tail
        cache[first[:, None] + torch.arange(tail, device=kv.device), 0] = saved

    # 4. the rings: each request's last `length` positions (the others into the padding slot)
    kept_rows = ring_rows(meta.tok_slot, pos, length, keep=pos >= meta.seg_end - length)
    ring_kv[kept_rows] = kv.to(ring_kv.dtype)
    ring_gate[kept_rows] = gate.to(ring_gate.dtype)

    return pooled
