"""DeepSeek-V4 on the paged KV cache with the Triton kernels (CUDA): one attention launch per
layer over every token of the step, reading its keys straight from the KV pages.

Where paged.py runs the reference layer per request chunk on gathered state, this path:
  1. projects q, the K=V rows, the indexer's queries and weights for all tokens of the step at
     once (they are per token), and writes every token's K=V row to the window pages first, so
     the attention kernel finds all window keys there (no gathered window);
  2. runs each compressor per chunk (its state is per request: pending block, overlap), from
     projections computed once for the step, without gathering the rows before the chunk
     (CompressorState.skipped_rows): the kernels read those from the pages. The rows a chunk
     completes are written to the pages as paged.py writes them (not below the write floor) and
     also handed to the kernels in one per-step tensor, with where each chunk's start
     (first_new, new_off), so a replayed chunk attends its recomputed rows as the reference does;
  3. CSA: scores every token against its complete index keys (triton_indexer.index_scores) and
     picks the top-k by a stable sort (ties to the earlier row, the reference's rule);
  4. attends (triton_attention.sparse_attention): window rows + picked (CSA) or all complete
     (HCA) compressed rows + sinks, then rotates back and projects out, all tokens at once.
What stays a Python loop per chunk is step 2 (the compressors' bookkeeping, a few small ops).

The reference path (paged.py) stays the CPU path and is the CUDA path under
attention_backend="reference"; V4KernelStepBackend is chosen when the engine's backend is one
with model_kernels (Triton).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.layers.attention.backends.base import AttentionMetadata, GroupMetadata, StepLayout
from deepinfer.models.deepseek_v4.attention import V4Attention
from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.norm import unit_rms
from deepinfer.models.deepseek_v4.paged import LayerKV, V4StepBackend, _ChunkPages, chunk_rows
from deepinfer.models.deepseek_v4.triton_attention import sparse_attention
from deepinfer.models.deepseek_v4.triton_indexer import index_scores, select_topk


@dataclass(kw_only=True)
class V4KernelMetadata(AttentionMetadata):
    """Per token of the step (row order): its chunk (row of the tables), position and window
    floor; per KV group, the chunks' block tables as one padded [chunks, blocks] int32 tensor."""

    tok_chunk: torch.Tensor
    tok_pos: torch.Tensor
    tok_floor: torch.Tensor
    tables: list[torch.Tensor]
    lows: dict = field(default_factory=dict)     # window -> [T] first key position per token

    def window_low(self, window: int) -> torch.Tensor:
        if window not in self.lows:
            self.lows[window] = torch.maximum(torch.clamp_min(self.tok_pos - (window - 1), 0),
                                              self.tok_floor).to(torch.int32).contiguous()
        return self.lows[window]


class V4KernelStepBackend(V4StepBackend):
    """V4StepBackend whose metadata also carries what the Triton kernels read."""

    name = "deepseek_v4_triton"
    kernels = True

    def build_metadata(self, step: StepLayout) -> AttentionMetadata:
        groups = [GroupMetadata(slot_mapping=m) for m in step.slot_mappings]
        rows = chunk_rows(step)
        chunk_of = np.concatenate([np.full(b - a, i, dtype=np.int32) for i, (_, a, b) in enumerate(rows)] or
                                  [np.zeros(0, np.int32)])
        pos = np.concatenate([np.arange(c.start, c.start + b - a, dtype=np.int32) for c, a, b in rows] or
                             [np.zeros(0, np.int32)])
        floor = np.concatenate([np.full(b - a, c.window_floor, dtype=np.int32) for c, a, b in rows] or
                               [np.zeros(0, np.int32)])
        tables = []
        for per_chunk in step.block_tables:
            width = max([len(t) for t in per_chunk] + [1])
            table = np.zeros((max(len(per_chunk), 1), width), dtype=np.int32)
            for i, t in enumerate(per_chunk):
                table[i, :len(t)] = t
            tables.append(step.to_device(table))
        return V4KernelMetadata(groups=groups, tok_chunk=step.to_device(chunk_of), tok_pos=step.to_device(pos),
                                tok_floor=step.to_device(floor), tables=tables, **step.metadata_fields(self))


def _compress_step(compressor: Compressor, x: torch.Tensor, pages: list[_ChunkPages], rows, index: int,
                   key, meta: V4KernelMetadata) -> dict:
    """Run one compressor over every chunk (projections once for the step), write what each chunk
    completed, and describe the compressed keys for the kernels (triton_attention's `comp`)."""
    kv_all, gate_all = compressor.kv_proj(x), compressor.gate_proj(x)
    new, first_new, new_off, offset, most = [], [], [], 0, 0
    for p, (_, a, b) in zip(pages, rows):
        state = p.compressor_state(index, compressor, key, gather_rows=False)
        held = compressor.compress(x[None, a:b], state, projected=(kv_all[None, a:b], gate_all[None, a:b]))
        p.write_compressor(index, compressor, state, key)
        first_new.append(state.skipped_rows)
        new_off.append(offset)
        offset += held.shape[1]
        most = max(most, state.num_rows)
        if held.shape[1]:
            new.append(held[0])
    cache = meta.kv_caches[meta.layer_to_slot[index]][0]
    new_rows = torch.cat(new) if new else cache.new_zeros(1, compressor.dim)
    starts = torch.tensor([first_new, new_off], dtype=torch.int32).to(x.device, non_blocking=True)
    per_page = meta.block_size // compressor.rate
    return dict(cache=cache, table=meta.tables[meta.layer_to_group[index]], new_rows=new_rows.contiguous(),
                first_new=starts[0], new_off=starts[1], rate=compressor.rate, per_page=per_page,
                page_rows=per_page + (2 * compressor.rate if compressor.overlap else 0), max_rows=most)


def attend_paged_kernels(attn: V4Attention, x: torch.Tensor, positions: torch.Tensor, meta: V4KernelMetadata,
                         kv: LayerKV, layer: int) -> torch.Tensor:
    """paged.attend_paged with the Triton kernels: x [tokens, hidden] -> [tokens, hidden]."""
    tokens = x.shape[0]
    q_residual = attn.q_a_norm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_residual).view(1, tokens, attn.heads, attn.head_dim)
    q = attn.rotary.rotate(unit_rms(q, attn.eps), positions)[0].contiguous()
    kv_rows = attn.kv_norm(attn.kv_proj(x))[None, :, None]
    kv_rows = attn.rotary.rotate(kv_rows, positions)[0, :, 0]                      # [T, D]
    # Every token's row first: the kernel reads the whole window from the pages (the reference
    # writes the same rows after its chunk; a chunk never reads another chunk's new positions).
    window_cache = meta.kv_caches[meta.layer_to_slot[kv.window]][0]
    window_cache[meta.groups[meta.layer_to_group[kv.window]].slot_mapping, 0] = kv_rows.to(window_cache.dtype)

    rows = chunk_rows(meta.step)
    comp = picks = None
    if attn.compressor is not None:
        pages = [_ChunkPages(meta, c) for c, _, _ in rows]
        comp = _compress_step(attn.compressor, x, pages, rows, kv.compressed, (layer, "compressor"), meta)
        if kv.index is not None:
            indexer = attn.compressor.indexer
            keys = _compress_step(indexer, x, pages, rows, kv.index, (layer, "indexer"), meta)
            qi = indexer.q_b_proj(q_residual).view(1, tokens, indexer.heads, indexer.dim)
            qi = indexer.rotary.rotate(qi, positions)[0].contiguous()
            weights = (indexer.scorer.weights_proj(x).float() * indexer.heads ** -0.5).contiguous()
            scores = index_scores(qi, weights, meta.tok_chunk, meta.tok_pos, keys, keys["max_rows"])
            picks = select_topk(scores, indexer.topk)

    out = sparse_attention(q, attn.sinks, meta.tok_chunk, meta.tok_pos, meta.window_low(attn.window), window_cache,
                           meta.tables[meta.layer_to_group[kv.window]], meta.block_size, comp, picks)
    out = attn.rotary.rotate(out[None], positions, inverse=True)[0]
    out = attn.o_a_proj(out.reshape(tokens, attn.o_groups, -1)).flatten(1)
    return attn.o_b_proj(out)
