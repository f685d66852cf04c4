"""The attention layer models use: writes this step's K/V into the paged cache, then attends.

The step's backend (backends/) decides how: which rows go to which kernel, where K/V come from.
This layer holds what is the layer's own (heads, scale, window) and the attention it computes
over K/V it is handed, which the backends call: `_decode` (one query per row, batched),
`_sdpa` (a masked chunk) and `_fresh_chunk` / `_fresh_chunks` (causal chunks over the step's
own K/V, SDPA's tiled kernels on the fast path). The backends see this layer through
backends/base.py's AttentionLayer protocol, so they never import this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepinfer.layers.attention.metadata import get_forward_context, wait_for_layer_load

if TYPE_CHECKING:
    from deepinfer.layers.rotary import RotaryEmbedding

# SDPA backends for fresh prefill chunks on the fast path, in order of preference (_causal_flash).
_TILED_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
# cuDNN builds an execution plan for every new query length, and each build stalls the step that
# meets the length, so a chunk's length is rounded up to a multiple of this before SDPA sees it
# (_fresh_chunk): at most max_num_batched_tokens / 256 plans, built once each. Figures:
# docs/benchmarks/design-measurements.md#sdpa-length-bucket
SDPA_LENGTH_BUCKET = 256


def equal_length_runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Fresh chunks as (start, end, count) runs for SDPA: adjacent chunks of one length that is a
    multiple of SDPA_LENGTH_BUCKET form one run, which one batched call takes as the rows lie
    (no padding, no copy; one batched cuDNN call is much faster than a call per chunk, figures in
    docs/benchmarks/design-measurements.md#sdpa-equal-length-runs). Every other chunk is a run of one."""
    runs: list[tuple[int, int, int]] = []
    for start, end in ranges:
        length = end - start
        if runs and length % SDPA_LENGTH_BUCKET == 0:
            run_start, run_end, count = runs[-1]
            if run_end == start and run_end - run_start == count * length:
                runs[-1] = (run_start, end, count + 1)
                continue
        runs.append((start, end, 1))
    return runs


class Attention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, sliding_window: int | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
                rotary: RotaryEmbedding | None = None) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] -> [tokens, heads*head_dim].

        With `rotary` (and `positions`), q and k are rotated here first, so that the fast path
        rotates them and writes K/V into the cache in one kernel (layers/fused/rotary.py)."""
        wait_for_layer_load(self.layer_id)   # a prefix still being loaded: this layer's part is in
        meta = get_forward_context()
        backend = meta.backend
        group = meta.groups[meta.layer_to_group[self.layer_id]]
        k_cache, v_cache = meta.kv_caches[meta.layer_to_slot[self.layer_id]]
        q, k = backend.write_kv(self, meta, group, q, k, v, positions, rotary, k_cache, v_cache)
        return backend.attend(self, meta, group, q, k, v, k_cache, v_cache).reshape(q.shape[0], -1)

    def _fresh_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                     end: int) -> torch.Tensor:
        """Causal attention of the step's rows [start, end) over themselves, computed over a
        length rounded up to SDPA_LENGTH_BUCKET. The extra rows come after the chunk, so its
        own rows never see them (causal) and their outputs are dropped. They are the step's
        next rows where it has them (no copy), zeros past its end."""
        length = end - start
        padded = -(-length // SDPA_LENGTH_BUCKET) * SDPA_LENGTH_BUCKET
        if start + padded <= q.shape[0]:
            rows = slice(start, start + padded)
            out = self._causal_flash(q[rows], k[rows], v[rows])
        else:
            extra = (0, 0, 0, 0, 0, padded - length)   # rows appended after the chunk's last
            out = self._causal_flash(*(F.pad(x[start:end], extra) for x in (q, k, v)))
        return out[:length]

    def _fresh_chunks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges: list[tuple[int, int]],
                      out: torch.Tensor) -> None:
        """Causal attention of each fresh chunk of `ranges` (the step's rows) over itself, into
        `out`: adjacent chunks of one bucket-aligned length in one batched call (equal_length_runs)."""
        for start, end, count in equal_length_runs(ranges):
            out[start:end] = (self._fresh_chunk(q, k, v, start, end) if count == 1
                              else self._causal_flash(q[start:end], k[start:end], v[start:end], count))

    def _causal_flash(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      batch: int = 1) -> torch.Tensor:
        """Causal attention of `batch` chunks of one length L, each over its own keys, laid one
        after the other: q: [batch * L, H, D], k/v: [batch * L, Hkv, D] -> [batch * L, H, D].

        Only exact tiled backends are allowed, cuDNN first, then flash: cuDNN's kernel runs a long
        causal prefill well ahead of flash (FA2), see
        docs/benchmarks/design-measurements.md#sdpa-tiled-backends. The math backend is
        excluded: it would materialise [H, L, L] scores (4 GiB at 8k tokens), so if neither
        tiled backend takes the call this raises instead. The views are [batch, H, L, D] over
        the token-major tensors ([batch, L, H, D] with the last dim contiguous), which both take
        without a copy going in; the result transposes back contiguous.
        """
        q4, k4, v4 = (x.unflatten(0, (batch, -1)).transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel(_TILED_BACKENDS, set_priority=True):
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=self.scale,
                                                 enable_gqa=self.num_kv_heads != self.num_heads)
        return out.transpose(1, 2).flatten(0, 1)

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """One query per row. q: [B, H, D], k/v: [B, L, Hkv, D], bias: [B, 1, 1, L] (0 / -inf) or None.

        Two batched matmuls with the query heads grouped under their KV head. On the CPU this is
        several times faster than SDPA's flash kernel, which is tiled for long queries.
        """
        # Computed in float32: exact softmax, and on the CPU small float32 matmuls beat bf16 ones.
        batch, group = q.shape[0], self.num_heads // self.num_kv_heads
        grouped_q = q.view(batch, self.num_kv_heads, group, self.head_dim).float()
        scores = torch.matmul(grouped_q, k.permute(0, 2, 3, 1).float()) * self.scale   # [B, Hkv, G, L]
        if bias is not None:
            scores = scores + bias
        out = torch.matmul(torch.softmax(scores, dim=-1), v.transpose(1, 2).float())
        return out.view(batch, self.num_heads, self.head_dim).to(q.dtype)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q: [B, Q, H, D], k/v: [B, L, Hkv, D], mask: [B, Q, L] (True = may attend; None = all)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.unsqueeze(1),
                                             scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)
        return out.transpose(1, 2)
