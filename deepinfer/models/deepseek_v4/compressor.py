"""The KV compressor: one row per `rate` consecutive tokens, a learned softmax-gated pooling.

For tokens t in block b (t = b*rate .. b*rate + rate - 1) each token projects a value c_t =
kv_proj(x_t) and a gate z_t = gate_proj(x_t) + position_bias[t - b*rate]; the row is

    row_b = rope(kv_norm(sum_t softmax_t(z_t) * c_t), position b * rate)

with the softmax taken per channel over the tokens of the block. HCA (rate 128) pools exactly
the block's tokens. CSA (rate 4) and its indexer overlap blocks: the projections are twice as
wide, the second half ("Cb") of block b's tokens and the first half ("Ca") of block b-1's tokens
pool together, 2 * rate slots (for block 0 the Ca slots are empty). So across calls the state
is: the projections of the incomplete block, and (overlap only) the last complete block's Ca.

Row b is only visible to queries at positions >= (b + 1) * rate - 1, i.e. once its last token
has been seen.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.layers.linear import Linear
from deepinfer.models.deepseek_v4.norm import V4RMSNorm
from deepinfer.models.deepseek_v4.rope import V4Rotary
from deepinfer.models.deepseek_v4.state import CompressorState


class Compressor(nn.Module):
    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float, rotary: V4Rotary) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = Linear(hidden, width, bias=False)
        self.gate_proj = Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = V4RMSNorm(dim, eps)
        self.__dict__["rotary"] = rotary          # shared with the attention; not a submodule

    def compress(self, x: torch.Tensor, state: CompressorState,
                 projected: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Feed the tokens x [B, L, hidden] (continuing `state`); returns every row so far,
        [B, rows, dim] (from state.skipped_rows on), and leaves `state` ready for the next call.
        `projected`: kv_proj(x) and gate_proj(x) already computed (batched over a step)."""
        kv, gate = projected if projected is not None else (self.kv_proj(x), self.gate_proj(x))
        state.call_kv, state.call_gate = kv, gate
        if state.pending_kv is not None:
            kv, gate = torch.cat([state.pending_kv, kv], dim=1), torch.cat([state.pending_gate, gate], dim=1)
        blocks = kv.shape[1] // self.rate
        done = blocks * self.rate
        state.pending_kv, state.pending_gate = kv[:, done:], gate[:, done:]
        if blocks == 0:
            if state.rows is None:
                state.rows = kv.new_zeros(kv.shape[0], 0, self.dim)
            return state.rows
        batch = kv.shape[0]
        kv = kv[:, :done].view(batch, blocks, self.rate, -1)
        gate = gate[:, :done].view(batch, blocks, self.rate, -1) + self.position_bias
        if self.overlap:
            d = self.dim
            prev_kv = kv.new_zeros(batch, 1, self.rate, d) if state.prev_kv is None else state.prev_kv[:, None]
            prev_gate = (gate.new_full((batch, 1, self.rate, d), float("-inf")) if state.prev_gate is None
                         else state.prev_gate[:, None])
            # Slots 0..rate-1: Ca of the block before; slots rate..2*rate-1: this block's Cb.
            slots_kv = torch.cat([torch.cat([prev_kv, kv[:, :-1, :, :d]], dim=1), kv[..., d:]], dim=2)
            slots_gate = torch.cat([torch.cat([prev_gate, gate[:, :-1, :, :d]], dim=1), gate[..., d:]], dim=2)
            state.prev_kv, state.prev_gate = kv[:, -1, :, :d].clone(), gate[:, -1, :, :d].clone()
        else:
            slots_kv, slots_gate = kv, gate
        weights = slots_gate.softmax(dim=2, dtype=torch.float32).to(slots_kv.dtype)
        rows = self.kv_norm((slots_kv * weights).sum(dim=2))
        first = state.num_rows
        positions = (torch.arange(blocks, device=rows.device) + first) * self.rate
        rows = self.rotary.rotate(rows.unsqueeze(2), positions).squeeze(2)
        state.rows = rows if state.rows is None else torch.cat([state.rows, rows], dim=1)
        return state.rows


def visible_rows(positions: torch.Tensor, num_rows: int, rate: int) -> torch.Tensor:
    """[L, rows] bool: row b is visible to the query at position p once (b + 1) * rate <= p + 1."""
    return torch.arange(num_rows, device=positions.device)[None, :] < ((positions + 1) // rate)[:, None]
