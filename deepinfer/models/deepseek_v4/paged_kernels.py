"""DeepSeek-V4 on the paged KV cache with the Triton kernels (CUDA): one attention launch per
layer over every token of the step, reading its keys straight from the KV pages.

Where paged.py runs the reference layer per request chunk on gathered state, this path:
  1. projects q, the K=V rows, the indexer's queries and weights for all tokens of the step at
     once (they are per token), and writes every token's K=V row to the window pages first, so
     the attention kernel finds all window keys there (no gathered window);
  2. runs each compressor over the whole step (step_compressor.py): the rows completed in the
     step are pooled on the device from the step's projections and each request's ring
     (rings.py), written to the pages (not below the write floor) and handed to the kernels as
     the step's new rows, with where each chunk's start (first_new, new_off), so a replayed
     chunk attends its recomputed rows as the reference does;
  3. CSA: scores every token against its complete index keys (triton_indexer.index_scores) and
     picks the top-k by a stable sort (ties to the earlier row, the reference's rule);
  4. attends (triton_attention.sparse_attention): window rows + picked (CSA) or all complete
     (HCA) compressed rows + sinks, then rotates back and projects out, all tokens at once.
Nothing in a decode step's forward waits for the host, so decode steps replay as CUDA graphs
(decode_graphs.py); the host's part of a step is its metadata (V4KernelStepBackend).

The reference path (paged.py) stays the CPU path and is the CUDA path under
attention_backend="reference"; V4KernelStepBackend is chosen when the engine's backend is one
with model_kernels (Triton).
"""

from __future__ import annotations

import torch

from deepinfer.layers.attention.backends.base import AttentionMetadata, GroupMetadata, StepLayout
from deepinfer.models.deepseek_v4.attention import V4Attention
from deepinfer.models.deepseek_v4.compressor import Compressor
from deepinfer.models.deepseek_v4.norm import unit_rms
from deepinfer.models.deepseek_v4.paged import LayerKV, V4StepBackend
from deepinfer.models.deepseek_v4.rings import ProjectionRings
from deepinfer.models.deepseek_v4.step_compressor import compress_step
from deepinfer.models.deepseek_v4.step_metadata import (
    V4KernelMetadata,
    padded_tables,
    seed_rings,
    token_layout,
)
from deepinfer.models.deepseek_v4.triton_attention import sparse_attention
from deepinfer.models.deepseek_v4.triton_indexer import index_scores, select_topk


class V4KernelStepBackend(V4StepBackend):
    """V4StepBackend whose metadata also carries what the Triton kernels and the step's
    compressors read."""

    name = "deepseek_v4_triton"
    kernels = True
    # One-row projections (batch-1 decode) on the Triton GEMV, as the Llama path runs them
    # (linear.one_row_gemv): cuBLAS's one-row kernels read V4's projections far below the copy
    # bandwidth (benchmarks/quant_gemm_speed.py's bf16 column).
    fused_gemv = True
    # The ops around the kernels in Triton too: at decode their launches, not their bytes, set
    # the step's time (V4RMSNorm, rope, SwiGLU, mHC, compressors, router: norm.py,
    # triton_rope.py, layers/fused/activation.py, triton_hyper.py, triton_compressor.py,
    # triton_router.py).
    fused_norm = True
    fused_rotary = True
    fused_activation = True
    fused_v4_ops = True

    def __init__(self, device: torch.device | None = None, kv_cache_dtype: torch.dtype | None = None,
                 rings: ProjectionRings | None = None, decode_graphs: bool = False) -> None:
        super().__init__(device, kv_cache_dtype, rings)
        # Decode steps replay as CUDA graphs (decode_graphs.py).
        self.supports_decode_graphs = decode_graphs

    def decode_graph_buffers(self, *, num_groups: int, max_batch: int, max_blocks_per_seq: int, num_kv_heads: int,
                             block_size: int, layer_to_group: list[int], layer_to_slot: list[int],
                             kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device):
        from deepinfer.models.deepseek_v4.decode_graphs import V4GraphBuffers

        return V4GraphBuffers(self, self.rings, num_groups, max_batch, max_blocks_per_seq, block_size,
                              layer_to_group, layer_to_slot, kv_caches, device)

    def build_metadata(self, step: StepLayout) -> AttentionMetadata:
        groups = [GroupMetadata(slot_mapping=m) for m in step.slot_mappings]
        tokens = token_layout(step, self.rings)
        tables = [step.to_device(t) for t in padded_tables(step)]
        meta = V4KernelMetadata(groups=groups, rings=self.rings, tables=tables,
                                **tokens.to_device(step),
                                host_pos=tokens.pos, chunk_starts=tokens.chunk_starts, **step.metadata_fields(self))
        seed_rings(meta, tokens.new_slots)
        return meta


def _compress(compressor: Compressor, x: torch.Tensor, meta: V4KernelMetadata, index: int, key) -> dict:
    cache = meta.kv_caches[meta.layer_to_slot[index]][0]
    return compress_step(compressor, x, meta, meta.rings, key, cache, meta.tables[meta.layer_to_group[index]])


def attend_paged_kernels(attn: V4Attention, x: torch.Tensor, positions: torch.Tensor, meta: V4KernelMetadata,
                         kv: LayerKV, layer: int) -> torch.Tensor:
    """paged.attend_paged with the Triton kernels: x [tokens, hidden] -> [tokens, hidden]."""
    tokens = x.shape[0]
    q_residual = attn.q_a_norm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_residual).view(1, tokens, attn.heads, attn.head_dim)
    tables = meta.rope_tables(attn.rotary, positions)
    q = attn.rotary.rotate(unit_rms(q, attn.eps), positions, tables=tables)[0].contiguous()
    kv_rows = attn.kv_norm(attn.kv_proj(x))[None, :, None]
    kv_rows = attn.rotary.rotate(kv_rows, positions, tables=tables)[0, :, 0]       # [T, D]
    # Every token's row first: the kernel reads the whole window from the pages (the reference
    # writes the same rows after its chunk; a chunk never reads another chunk's new positions).
    window_cache = meta.kv_caches[meta.layer_to_slot[kv.window]][0]
    window_cache[meta.groups[meta.layer_to_group[kv.window]].slot_mapping, 0] = kv_rows.to(window_cache.dtype)

    comp = picks = None
    if attn.compressor is not None:
        comp = _compress(attn.compressor, x, meta, kv.compressed, (layer, "compressor"))
        if kv.index is not None:
            indexer = attn.compressor.indexer
            keys = _compress(indexer, x, meta, kv.index, (layer, "indexer"))
            qi = indexer.q_b_proj(q_residual).view(1, tokens, indexer.heads, indexer.dim)
            qi_tables = meta.rope_tables(indexer.rotary, positions)
            qi = indexer.rotary.rotate(qi, positions, tables=qi_tables)[0].contiguous()
            weights = (indexer.scorer.weights_proj(x).float() * indexer.heads ** -0.5).contiguous()
            scores = index_scores(qi, weights, meta.tok_chunk, meta.tok_pos, keys, keys["max_rows"])
            picks = select_topk(scores, indexer.topk)

    out = sparse_attention(q, attn.sinks, meta.tok_chunk, meta.tok_pos, meta.window_low(attn.window), window_cache,
                           meta.tables[meta.layer_to_group[kv.window]], meta.block_size, comp, picks)
    out = attn.rotary.rotate(out[None], positions, inverse=True, tables=tables)[0]
    out = attn.o_a_proj(out.reshape(tokens, attn.o_groups, -1)).flatten(1)
    return attn.o_b_proj(out)
