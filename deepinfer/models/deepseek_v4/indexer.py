"""CSA's Lightning Indexer: which compressed rows each query attends to.

It keeps its own compressed keys (an overlapping Compressor at `index_head_dim`, same rate and
rope as the attention's compressor) and scores query t against row s as

    score(t, s) = sum_h w_{t,h} * relu(q_{t,h} . k_s) / sqrt(index_head_dim)

with q = rope(q_b_proj(q_residual)) split into `index_n_heads` heads (q_residual is the
attention's normed low-rank query, so the indexer shares q_a_proj) and per-head weights
w_t = weights_proj(x_t) / sqrt(index_n_heads). Rows not yet complete at t score -inf; the query
keeps the `index_topk` best (all of its complete rows when it has fewer), ties to the earlier row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.linear import Linear
from deepinfer.models.deepseek_v4.compressor import Compressor, visible_rows
from deepinfer.models.deepseek_v4.rope import V4Rotary
from deepinfer.models.deepseek_v4.state import CompressorState


class _Scorer(nn.Module):
    """Holds the per-head query weights (named as in the HF layout: indexer.scorer.weights_proj)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weights_proj = Linear(hidden, heads, bias=False)


class Indexer(Compressor):
    def __init__(self, hidden: int, q_lora_rank: int, heads: int, dim: int, rate: int, topk: int,
                 eps: float, rotary: V4Rotary) -> None:
        super().__init__(hidden, dim, rate, overlap=True, eps=eps, rotary=rotary)
        self.heads, self.topk = heads, topk
        self.q_b_proj = Linear(q_lora_rank, heads * dim, bias=False)
        self.scorer = _Scorer(hidden, heads)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
               state: CompressorState) -> torch.Tensor:
        """[B, L, rows] bool: the compressed rows (of the attention's compressor, which emits rows
        in step with this one) each of the L queries attends to."""
        keys = self.compress(x, state)                                    # [B, rows, dim]
        batch, length, _ = x.shape
        num_rows = keys.shape[1]
        if num_rows == 0:
            return torch.zeros(batch, length, 0, dtype=torch.bool, device=x.device)
        q = self.q_b_proj(q_residual).view(batch, length, self.heads, self.dim)
        q = self.rotary.rotate(q, positions)
        dots = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))   # [B, L, heads, rows]
        dots = F.relu(dots) * self.dim ** -0.5
        head_weights = self.scorer.weights_proj(x).float() * self.heads ** -0.5     # [B, L, heads]
        scores = (dots * head_weights.unsqueeze(-1)).sum(dim=2)                    # [B, L, rows]
        complete = visible_rows(positions, num_rows, self.rate)                    # [L, rows]
        scores = scores.masked_fill(~complete, float("-inf"))
        # The k best by a stable sort: equal scores (all heads' relu at 0 gives exact ties) go to
        # the earlier row, so a query picks the same rows however many later rows the call holds.
        # (torch.topk leaves ties unspecified; transformers' selection then depends on the call.)
        picked = scores.sort(dim=-1, descending=True, stable=True).indices[..., :min(self.topk, num_rows)]
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, picked, True)
        return chosen & complete
