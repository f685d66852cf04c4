"""Tensor-parallel layers: each rank holds a slice of a weight and the ranks combine their parts.

    ColumnParallelLinear   output features split (q/k/v heads, gate/up rows): no communication;
                           several fused HF projections split part by part
    RowParallelLinear      input features split (o_proj, down_proj): partial sums all-reduced
    VocabParallelEmbedding vocabulary rows split: each rank looks up its own ids, all-reduce
    ParallelLMHead         vocabulary rows split: logits all-gathered

The weights always arrive whole, in HF layout, from any source (safetensors or a dequantized
GGUF); `rank_part` cuts out this rank's slice, so loaders never know about ranks. On one rank
every class is its plain counterpart: the same parameters, the same results, no collective.

KV heads fewer than ranks are replicated: with 8 ranks and 2 KV heads, ranks 0-3 hold head 0 and
ranks 4-7 head 1, each beside the query heads that read it (vLLM and SGLang do the same).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed import ParallelGroup, current_tp_group
from deepinfer.layers.linear import FusedLinear, Linear


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


class ColumnParallelLinear(FusedLinear):
    """HF projections side by side in the output (as FusedLinear), each split over the ranks.

    part_sizes: the full output size of each fused HF projection. units: per part, how many
    heads (or other indivisible units) it holds; default: its rows, any split. A part with fewer
    units than ranks (KV heads) is replicated: each rank keeps the one unit its query heads read.
    """

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool, *,
                 units: list[int] | None = None, group: ParallelGroup | None = None) -> None:
        self.group = group or current_tp_group()
        units = units or part_sizes
        self.full_sizes, self.units = list(part_sizes), list(units)
        super().__init__(in_features, [self._local_size(i) for i in range(len(part_sizes))], bias=bias)

    def _local_size(self, part: int) -> int:
        size, units, ranks = self.full_sizes[part], self.units[part], self.group.size
        unit = size // units
        if units >= ranks:
            return divide(units, ranks, "heads of a projection") * unit
        divide(ranks, units, f"ranks over a projection's {units} heads")   # replication must be even
        return unit

    def rank_part(self, tensor: torch.Tensor, part: int) -> torch.Tensor:
        """This rank's rows of the full HF tensor of part `part` (weight or bias)."""
        if self.group.size == 1:
            return tensor
        local = self.shard_sizes[part]
        units, ranks = self.units[part], self.group.size
        index = self.group.rank if units >= ranks else self.group.rank // (ranks // units)
        return tensor[index * local:(index + 1) * local]


class RowParallelLinear(Linear):
    """Input features split over the ranks; each rank's partial product is summed by an
    all-reduce, and the bias added once, after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, *,
                 group: ParallelGroup | None = None) -> None:
        self.group = group or current_tp_group()
        super().__init__(divide(in_features, self.group.size, "input features of a projection"),
                         out_features, bias=bias)

    def rank_part(self, tensor: torch.Tensor, part: int = 0) -> torch.Tensor:
        if self.group.size == 1 or tensor.dim() == 1:   # the bias is whole on every rank
            return tensor
        local = self.in_features
        return tensor[:, self.group.rank * local:(self.group.rank + 1) * local]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return super().forward(x)
        y = self.matmul(x, None)
        if self.lora is not None:   # this rank's columns of the adapters' A (lora/slots.py): a partial sum too
            y = self.lora.add(x, y)
        y = self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """The vocabulary's rows split over the ranks (padded to a multiple of them): a rank looks up
    the ids in its range, zeros the rest, and the all-reduce puts every row together."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: ParallelGroup | None = None) -> None:
        self.group = group or current_tp_group()
        self.vocab_size = num_embeddings
        local = -(-num_embeddings // self.group.size)
        super().__init__(local if self.group.size > 1 else num_embeddings, embedding_dim)
        self.vocab_start = self.group.rank * local

    def rank_part(self, tensor: torch.Tensor, part: int = 0) -> torch.Tensor:
        return _vocab_rows(self.group, tensor, self.vocab_start, self.num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """The output head's vocabulary rows split as VocabParallelEmbedding's (so a tied head is
    the embedding's own slice). Its forward gives this rank's columns of the logits; the model's
    `compute_logits` gathers them (gather_logits)."""

    def __init__(self, hidden_size: int, vocab_size: int, *, group: ParallelGroup | None = None) -> None:
        self.group = group or current_tp_group()
        self.vocab_size = vocab_size
        local = -(-vocab_size // self.group.size) if self.group.size > 1 else vocab_size
        super().__init__(hidden_size, local, bias=False)
        self.vocab_start = self.group.rank * local

    def rank_part(self, tensor: torch.Tensor, part: int = 0) -> torch.Tensor:
        return _vocab_rows(self.group, tensor, self.vocab_start, self.out_features)


def gather_logits(group: ParallelGroup, local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's vocabulary columns side by side, without the padding rows' columns."""
    if group.size == 1:
        return local_logits
    return group.all_gather(local_logits, dim=-1)[..., :vocab_size]


def _vocab_rows(group: ParallelGroup, tensor: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows start..start+rows of a full [vocab, hidden] tensor; the last rank's padding rows zero."""
    if group.size == 1:
        return tensor
    part = tensor[start:start + rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])])
    return part
