"""DeepSeek-V4 over tensor-parallel ranks: what each rank keeps, and expert parallelism for the MoE.

Split over the tp ranks of the group (rank r):
  attention   the query heads: q_b_proj column-parallel by heads, `sinks` by heads; the grouped
              output projection by groups: o_a_proj keeps rank r's o_groups / tp groups, whose
              input channels are exactly its heads' (heads / tp = (o_groups / tp) * heads per
              group), and o_b_proj is row-parallel: the attention's one all-reduce
  MoE (TP)    every routed expert's and the shared expert's intermediate size (gate / up rows
              column-, down columns row-parallel: SwiGLU is per channel, so each rank's part is
              exact); the ranks' partial sums of routed and shared experts are added and reduced
              once per layer
  MoE (EP)    whole routed experts (enable_expert_parallel): rank r holds experts
              [r E/tp, (r+1) E/tp); the shared expert is replicated (one expert's weights, run on
              the rank's share of the tokens)
  vocabulary  the embedding and the head (layers/parallel.py); the logits are all-gathered
Replicated on every rank: the single shared K=V head (MQA: every rank computes it and keeps the
whole KV cache, whose spec stays one head), q_a_proj / q_a_norm (the indexer reads the low-rank
query whole), the compressors and the Lightning Indexer, mHC, the norms, the router and MTP's
front. The indexer's top-k must be the same on every rank (each rank attends its heads to the
rows it picks); replication guarantees it, as every rank runs the same weights on the same bits
(the all-reduces give every rank identical sums).

Expert parallelism with tokens that every rank holds (tensor parallelism keeps the activations
replicated) has two exact forms, chosen by ParallelConfig.expert_parallel_dispatch:
  all_to_all  (default) rank r routes its share of the tokens (`token_share`), sends each
              (token, expert) pair's row to the rank of its expert and gets the expert's output
              back (two all-to-alls, after one of the per-expert counts), weights and sums them,
              adds the shared expert, and the ranks' shares are all-gathered;
  all_reduce  every rank routes every token, runs its own experts on the pairs routed to them
              and the shared expert on its share of the tokens; one all-reduce sums the parts.
Both compute each (token, expert) pair once, on the rank holding the expert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.distributed import ParallelGroup
from deepinfer.models.deepseek_v4.config import V4Config


def check_parallel_sizes(cfg: V4Config, tp: int, expert_parallel: bool) -> None:
    """A ValueError naming the first config field that tensor_parallel_size does not divide:
    the query heads and the output groups, and the routed experts (expert parallelism) or the
    experts' intermediate size (tensor parallelism)."""
    if tp == 1:
        return
    fields = [("num_attention_heads", cfg.num_heads), ("o_groups", cfg.o_groups)]
    fields.append(("n_routed_experts", cfg.num_experts) if expert_parallel
                  else ("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, value in fields:
        if value % tp:
            mode = " with enable_expert_parallel" if name == "n_routed_experts" else ""
            raise ValueError(f"DeepSeek-V4: {name} ({value}) is not divisible by "
                             f"tensor_parallel_size ({tp}){mode}")


def check_group(cfg: V4Config, group: ParallelGroup) -> None:
    check_parallel_sizes(cfg, group.size, group.enable_expert_parallel)


def rank_rows(total: int, group: ParallelGroup) -> slice:
    """Rank's contiguous 1/size of `total` units (divisibility checked by check_parallel_sizes)."""
    part = total // group.size
    return slice(group.rank * part, (group.rank + 1) * part)


def token_share(tokens: int, group: ParallelGroup) -> slice:
    """The tokens rank r dispatches: ceil(tokens / size) each, in order; the last shares may be
    short or empty. All shares padded to the same size and concatenated in rank order thus begin
    with the tokens in their order (what `all_gather` of the padded shares relies on)."""
    per = -(-tokens // group.size)
    start = min(group.rank * per, tokens)
    return slice(start, min(start + per, tokens))


@dataclass(frozen=True)
class Dispatch:
    """Where a rank's (token, slot) pairs go: `order` sorts the flattened pairs by expert id (so
    by destination rank, experts being split in contiguous ranges); `expert_counts` [E] counts
    the pairs per expert, `send_counts` per rank."""

    order: torch.Tensor
    expert_counts: torch.Tensor
    send_counts: list[int]


def plan_dispatch(ids: torch.Tensor, num_experts: int, ranks: int) -> Dispatch:
    """ids [T, k] global expert ids -> the pairs' order and counts (rank r holds experts
    [r E/ranks, (r+1) E/ranks))."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return Dispatch(order, counts, counts.view(ranks, -1).sum(dim=1).tolist())


def received_experts(recv_expert_counts: torch.Tensor) -> torch.Tensor:
    """recv_expert_counts [ranks, local experts] (rows from source rank s for local expert e)
    -> the local expert id of every received row, in arrival order (source rank, then expert)."""
    ranks, local = recv_expert_counts.shape
    experts = torch.arange(local, device=recv_expert_counts.device).repeat(ranks)
    return experts.repeat_interleave(recv_expert_counts.reshape(-1))


Route = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def expert_parallel_moe(x: torch.Tensor, token_ids: torch.Tensor | None, route: Route, experts,
                        shared: Callable[[torch.Tensor], torch.Tensor], group: ParallelGroup) -> torch.Tensor:
    """The MoE output [T, hidden] for tokens x [T, hidden] (and their ids [T], for hash routing)
    that every rank holds. route(x, token_ids) -> (global expert ids, weights) [T, k] is the
    replicated router; `experts` (moe.RoutedExperts) holds this rank's experts first_expert ..
    first_expert + num_local of num_experts, called as experts(rows, local ids [N, k], weights
    [N, k]); `shared` is the replicated shared expert."""
    if group.expert_parallel_dispatch == "all_reduce":
        return _by_all_reduce(x, token_ids, route, experts, shared, group)
    return _by_all_to_all(x, token_ids, route, experts, shared, group)


def _by_all_reduce(x, token_ids, route, experts, shared, group) -> torch.Tensor:
    ids, weights = route(x, token_ids)
    out = torch.zeros_like(x)
    first, last = experts.first_expert, experts.first_expert + experts.num_local
    token, slot = ((ids >= first) & (ids < last)).nonzero(as_tuple=True)
    if token.numel():
        local = (ids[token, slot] - first)[:, None]
        out.index_add_(0, token, experts(x[token], local, weights[token, slot, None]))
    share = token_share(x.shape[0], group)
    out[share] += shared(x[share])
    return group.all_reduce(out)


def _by_all_to_all(x, token_ids, route, experts, shared, group) -> torch.Tensor:
    share = token_share(x.shape[0], group)
    mine = x[share]
    ids, weights = route(mine, None if token_ids is None else token_ids[share])
    k, per_rank = ids.shape[1], experts.num_local
    plan = plan_dispatch(ids, experts.num_experts, group.size)
    # Per-expert counts first: each rank learns how many rows it gets for each of its experts.
    recv_expert_counts = group.all_to_all(plan.expert_counts, [per_rank] * group.size,
                                          [per_rank] * group.size).view(group.size, per_rank)
    recv_counts = recv_expert_counts.sum(dim=1).tolist()
    pair_token = plan.order // k
    rows = group.all_to_all(mine[pair_token], plan.send_counts, recv_counts)
    local = received_experts(recv_expert_counts)
    if rows.shape[0]:   # each received row is one pair: weight 1 here, the pair's weight at home
        rows = experts(rows, local[:, None], torch.ones_like(local, dtype=weights.dtype)[:, None])
    back = group.all_to_all(rows, recv_counts, plan.send_counts)    # the same rows, in send order
    out = shared(mine)
    out = out.index_add(0, pair_token, (back * weights.reshape(-1)[plan.order, None]).to(out.dtype))
    per = -(-x.shape[0] // group.size)
    if out.shape[0] < per:
        out = torch.cat([out, out.new_zeros(per - out.shape[0], out.shape[1])])
    return group.all_gather(out, dim=0)[:x.shape[0]]
