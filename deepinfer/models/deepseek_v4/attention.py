"""V4 attention: one shared K=V head (MQA), a sliding window over raw rows, optionally
compressed rows on top (HCA: all complete rows; CSA: the indexer's top-k), per-head sinks,
and a grouped low-rank output projection.

Shapes (B batch, L new tokens, H heads, D head_dim, r rope_dim):
  q_residual = q_a_norm(q_a_proj(x))                  [B, L, q_lora_rank]
  q          = rope(unit_rms(q_b_proj(q_residual)))   [B, L, H, D]   (rms per head, no weight)
  kv         = rope(kv_norm(kv_proj(x)))              [B, L, D]      (the key AND the value)
rope turns the last r channels of each head (interleaved pairs). Query t sees the raw rows of
positions t - window + 1 .. t and the compressed rows the layer kind allows. Each head has a
learned sink logit s_h that joins the softmax and is then dropped:
  p = softmax([q.k_1, ..., q.k_n, s_h] / ...)[:n]      (the scale D^-0.5 is on q.k only)
so heads can put weight "nowhere". As values carry rope too, the output's rope channels are
turned back by -t. The H*D output splits into o_groups groups; o_a_proj maps each group
(H*D/G channels) to o_lora_rank with its own block of the weight, o_b_proj mixes the
G * o_lora_rank result to hidden.

Under tensor parallelism (parallel.py) a rank holds H / tp query heads and their o_groups / tp
groups of the output projection; the K=V head, the compressor and the indexer are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.distributed import ParallelGroup, current_tp_group
from deepinfer.layers.linear import Linear, one_row_gemv
from deepinfer.layers.parallel import ColumnParallelLinear, RowParallelLinear
from deepinfer.layers.quantization import fp8
from deepinfer.models.deepseek_v4.compressor import Compressor, visible_rows
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from deepinfer.models.deepseek_v4.indexer import Indexer
from deepinfer.models.deepseek_v4.norm import V4RMSNorm, unit_rms
from deepinfer.models.deepseek_v4.parallel import check_group, rank_rows
from deepinfer.models.deepseek_v4.rope import V4Rotary
from deepinfer.models.deepseek_v4.state import LayerState


class CSACompressor(Compressor):
    """The attention's overlapping compressor with its indexer as a child (HF layout:
    self_attn.compressor.indexer.*)."""

    def __init__(self, cfg: V4Config, rotary: V4Rotary) -> None:
        rate = cfg.rate(CSA)
        super().__init__(cfg.hidden_size, cfg.head_dim, rate, overlap=True, eps=cfg.rms_norm_eps, rotary=rotary)
        self.indexer = Indexer(cfg.hidden_size, cfg.q_lora_rank, cfg.index_heads, cfg.index_head_dim, rate,
                               cfg.index_topk, cfg.rms_norm_eps, rotary)


class GroupedLinear(Linear):
    """Block-diagonal linear: `groups` independent maps in_per_group -> out_per_group, stored as
    one [groups * out_per_group, in_per_group] weight (group g owns rows g*out .. (g+1)*out).
    Over several ranks each holds its groups / size consecutive groups (`group`: split, so a
    checkpoint's FP8 blocks are dequantized at load, as other split layers' are).

    A Linear for the weight's formats: DeepSeek-V4's checkpoints store it (wo_a) as FP8 128 x 128
    blocks, kept so (formats.py) and multiplied by fp8.fp8_grouped_linear, or at one row by the
    GEMV with a row of x per group (fused/gemv.py)."""

    def __init__(self, in_per_group: int, out_total: int, groups: int,
                 group: ParallelGroup | None = None) -> None:
        tp = group or current_tp_group()
        super().__init__(in_per_group, out_total // tp.size, bias=False)
        self.group = tp
        self.groups = groups // tp.size

    def rank_part(self, tensor: torch.Tensor, part: int = 0) -> torch.Tensor:
        """This rank's groups' rows of the whole [groups * out_per_group, in_per_group] weight."""
        return tensor if self.group.size == 1 else tensor[rank_rows(tensor.shape[0], self.group)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., groups, in_per_group] -> [..., groups, out_per_group]."""
        if one_row_gemv(x.flatten(-2)):   # one token
            from deepinfer.layers.fused.gemv import gemv  # imports triton: CUDA fast path only
            y = gemv(x.reshape(self.groups, -1), self.weight, scale=self.weight_scale, block=self.weight_block,
                     groups=self.groups)
            return y.view(*x.shape[:-1], -1)
        if self.is_fp8:
            return fp8.fp8_grouped_linear(x, self.weight, self.weight_scale, self.weight_block)
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("...gi,goi->...go", x, w)


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer_type: str, rotaries: dict[str, V4Rotary]) -> None:
        super().__init__()
        self.tp = current_tp_group()
        check_group(cfg, self.tp)
        self.layer_type = layer_type
        self.heads = cfg.num_heads // self.tp.size                     # this rank's query heads
        self.head_dim, self.window = cfg.head_dim, cfg.sliding_window
        self.eps = cfg.rms_norm_eps
        hidden, width = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        # Replicated: the low-rank query (the indexer reads it whole) and the one K=V head.
        self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, [width], bias=False, units=[cfg.num_heads])
        self.kv_proj = Linear(hidden, self.head_dim, bias=False)
        self.kv_norm = V4RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # Split by groups: a rank's heads are exactly its groups' channels (parallel.py).
        self.o_a_proj = GroupedLinear(width // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
        self.o_groups = self.o_a_proj.groups
        self.o_b_proj = RowParallelLinear(cfg.o_groups * cfg.o_lora_rank, hidden, bias=False)
        # The only parameter held by this module itself (so `rank_part` is the sinks').
        self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        # The compressor and the indexer are replicated: every rank computes the same rows and
        # the same top-k from the same inputs, so all heads of a query attend to the same rows.
        rotary = rotaries["main" if layer_type == SLIDING else "compress"]
        self.__dict__["rotary"] = rotary
        if layer_type == CSA:
            self.compressor = CSACompressor(cfg, rotary)
        elif layer_type == HCA:
            self.compressor = Compressor(hidden, self.head_dim, cfg.rate(HCA), overlap=False,
                                         eps=cfg.rms_norm_eps, rotary=rotary)
        else:
            self.compressor = None

    def rank_part(self, tensor: torch.Tensor, part: int = 0) -> torch.Tensor:
        """This rank's heads' entries of the whole `sinks`."""
        return tensor if self.tp.size == 1 else tensor[rank_rows(tensor.shape[0], self.tp)]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: LayerState) -> torch.Tensor:
        """x [B, L, hidden] for positions [L] (consecutive, continuing `state`) -> [B, L, hidden]."""
        return self.o_b_proj(self.low_rank_out(x, positions, state))

    def low_rank_out(self, x: torch.Tensor, positions: torch.Tensor, state: LayerState) -> torch.Tensor:
        """The attention up to o_b_proj's input: [B, L, this rank's o_groups * o_lora_rank] (the
        paged path runs o_b_proj, and its all-reduce, once over every chunk of a step)."""
        batch, length, _ = x.shape
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(batch, length, self.heads, self.head_dim)
        q = self.rotary.rotate(unit_rms(q, self.eps), positions)
        kv = self.kv_norm(self.kv_proj(x)).unsqueeze(2)
        kv = self.rotary.rotate(kv, positions).squeeze(2)                  # [B, L, D]
        state.call_rows = kv

        # Raw rows: the kept tail of the window, then this call's tokens.
        keys = kv if state.window is None else torch.cat([state.window, kv], dim=1)
        key_pos = torch.arange(keys.shape[1], device=x.device) + (positions[0] - (keys.shape[1] - length))
        state.window = keys[:, keys.shape[1] - min(keys.shape[1], self.window - 1):]
        sees = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] > positions[:, None] - self.window)
        sees = sees.expand(batch, -1, -1)
        if self.compressor is not None:
            rows = self.compressor.compress(x, state.compressor)         # [B, rows, D]
            if self.layer_type == CSA:
                chosen = self.compressor.indexer.select(x, q_residual, positions, state.indexer)
            else:
                chosen = visible_rows(positions, rows.shape[1], self.compressor.rate).expand(batch, -1, -1)
            keys, sees = torch.cat([keys, rows], dim=1), torch.cat([sees, chosen], dim=-1)

        logits = torch.einsum("blhd,bsd->bhls", q, keys) * self.head_dim ** -0.5
        logits = logits.masked_fill(~sees[:, None], float("-inf"))
        sink = self.sinks.to(logits.dtype).view(1, -1, 1, 1).expand(batch, -1, length, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = torch.einsum("bhls,bsd->blhd", probs.to(keys.dtype), keys)  # [B, L, H, D]
        out = self.rotary.rotate(out, positions, inverse=True)
        return self.o_a_proj(out.reshape(batch, length, self.o_groups, -1)).flatten(2)
