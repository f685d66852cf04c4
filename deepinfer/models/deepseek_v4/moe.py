"""V4's feed-forward: a routed MoE plus one always-on shared expert, SwiGLU with a clamp.

Scores s = sqrtsoftplus(router(x)) per expert (sqrt(softplus(.)); "sigmoid" / "softmax" also
read). A learned router ("moe") picks the top-k of s + e_score_correction_bias (the bias only
chooses, it never weights); a hash router ("hash_moe", the first layers) takes the k experts
from a fixed table tid2eid[token id]. Either way the weights are the chosen s renormalised to
sum 1, times routed_scaling_factor. Each expert and the shared one compute
  down(silu(min(gate, limit)) * clamp(up, -limit, limit))          limit = swiglu_limit
Routed experts are stored stacked as in the HF layout: gate_up_proj [E, 2I, hidden] (gate rows
first), down_proj [E, hidden, I]. The reference loops over experts; the engine runs them as
two grouped GEMMs (torch._grouped_mm) where it can.

Under tensor parallelism (parallel.py) each rank holds every expert's 1/tp of the intermediate
rows, or with expert parallelism 1/tp of the routed experts whole; `rank_part` cuts a rank's
part out of a whole checkpoint tensor (weights.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed import ParallelGroup, current_tp_group
from deepinfer.layers.attention.metadata import current_backend
from deepinfer.layers.linear import one_row_gemv
from deepinfer.layers.parallel import ColumnParallelLinear, RowParallelLinear
from deepinfer.layers.quantization import fp4
from deepinfer.models.deepseek_v4.config import V4Config
from deepinfer.models.deepseek_v4.parallel import check_group, expert_parallel_moe, rank_rows


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate clamped to <= limit) * (up clamped to +-limit); one Triton kernel where the
    forward's backend turns on fused_activation (layers/fused/activation.py)."""
    if current_backend().fused_activation:
        from deepinfer.layers.fused.activation import gated_act
        return gated_act(gate, up, "silu", limit)
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class SharedExpert(nn.Module):
    """The dense SwiGLU MLP (the shared expert; names gate_proj / up_proj / down_proj). Over a
    group of several ranks its intermediate rows are split and `forward` returns this rank's
    partial sum, not reduced: V4MoE reduces it with the routed experts' in one all-reduce."""

    def __init__(self, hidden: int, inner: int, limit: float, group: ParallelGroup | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = ColumnParallelLinear(hidden, [inner], bias=False, group=group)
        self.up_proj = ColumnParallelLinear(hidden, [inner], bias=False, group=group)
        self.down_proj = RowParallelLinear(inner, hidden, bias=False, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit)
        # matmul, not forward: the row-parallel product without its own all-reduce (no bias). So
        # the LoRA products forward would add are added here, as RowParallelLinear.forward does:
        # this rank's columns of the adapters' A, a partial sum reduced with the rest.
        y = self.down_proj.matmul(h, None)
        if self.down_proj.lora is not None:   # adapters attached (lora/slots.py)
            y = self.down_proj.lora.add(h, y)
        return y


class Router(nn.Module):
    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.top_k, self.func = hashed, cfg.experts_per_token, cfg.scoring_func
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        if self.func == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        if self.func == "sigmoid":
            return logits.sigmoid()
        if self.func == "softmax":
            return logits.softmax(dim=-1)
        raise ValueError(f"scoring_func {self.func!r} is not supported")

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k], weights [T, k]). After the projection, one Triton
        kernel where the forward's backend turns on fused_v4_ops (triton_router.py)."""
        if self.hashed and token_ids is None:
            raise ValueError("a hash-routed layer needs the token ids")
        if one_row_gemv(x):   # batch-1 decode: the Triton GEMV, as the projections (linear.py)
            from deepinfer.layers.fused.gemv import gemv
            logits = gemv(x, self.weight)
        else:
            logits = F.linear(x, self.weight)
        if current_backend().fused_v4_ops:
            from deepinfer.models.deepseek_v4.triton_router import route
            return route(logits, self.func, self.top_k, self.scaling,
                         None if self.hashed else self.e_score_correction_bias,
                         self.tid2eid if self.hashed else None, token_ids)
        s = self.scores(logits)
        if self.hashed:
            ids = self.tid2eid[token_ids.reshape(-1)].long()
        else:
            ids = torch.topk(s + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        w = s.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, w * self.scaling


# FP4 experts whose tiling takes this many rows an expert (a prefill) run as bf16 grouped GEMMs
# over dequantized chunks (fp4_moe_triton.fp4_grouped_mm_dequantized): there the FP4 kernel's
# tensor-core tiles are far slower than bf16's grouped GEMM
# (docs/benchmarks/design-measurements.md#fp4-expert-tiles).
PREFILL_ROWS = 128
# From this many (token, pick) rows on (a prefill), the experts' outputs are combined per token by
# a gather and a sum instead of index_add_ (RoutedExperts.forward_grouped).
GATHER_COMBINE_ROWS = 4096
# Up to this many rows, V4's Triton path sorts and combines them in two kernels (triton_moe.py).
FUSED_DISPATCH_PAIRS = 1024


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Where torch's grouped GEMM runs: the CPU (any float dtype), CUDA in bf16 on Hopper or later."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def fp4_grouped_supported(x: torch.Tensor) -> bool:
    """Where the FP4 experts' Triton kernel runs: CUDA, 16-bit activations, and a device on which
    it compiled and matched the reference (layers/quantization/fp4_moe_triton.py, kernel_works)."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        from deepinfer.layers.quantization.fp4_moe_triton import kernel_works
    except ImportError:   # no Triton
        return False
    return kernel_works(x.device, x.dtype)


class RoutedExperts(nn.Module):
    """The routed experts this rank holds: all of them, each with its 1/tp of the intermediate
    rows (tensor parallelism), or experts first_expert .. first_expert + num_local whole (expert
    parallelism); on one rank all, whole. forward takes local expert ids."""

    def __init__(self, cfg: V4Config, group: ParallelGroup | None = None) -> None:
        super().__init__()
        self.group = group or current_tp_group()
        self.num_experts, hidden, self.inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.expert_parallel = self.group.size > 1 and self.group.enable_expert_parallel
        mine = rank_rows(self.num_experts, self.group) if self.expert_parallel else slice(0, self.num_experts)
        self.first_expert, self.num_local = mine.start, mine.stop - mine.start
        inner = self.inner if self.expert_parallel else self.inner // self.group.size
        self.limit = cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(self.num_local, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.zeros(self.num_local, hidden, inner))
        # The engine turns on the grouped GEMM (engine.py); the reference loops over experts.
        self.grouped = False
        # FP4 (as_fp4): the two parameters hold e2m1 codes, these their ue8m0 exponents per group
        # (buffers, so they move with the module; not in its state dict: the loader fills them).
        self.fp4_group: int | None = None
        self.register_buffer("gate_up_exps", None, persistent=False)
        self.register_buffer("down_exps", None, persistent=False)

    def as_fp4(self, group: int) -> None:
        """Keep the experts as a checkpoint's FP4 stores them (layers/quantization/fp4.py), for the
        loader to fill: gate_up_proj / down_proj become uint8 codes [E, rows, inputs / 2] and
        gate_up_exps / down_exps the exponent bytes [E, rows, inputs / group] (zero codes until
        then); the wider copies are freed. Experts already FP4 in groups of `group` stay."""
        if self.fp4_group == group:
            return
        device = self.gate_up_proj.device
        for name in ("gate_up_proj", "down_proj"):
            experts, rows, inputs = getattr(self, name).shape
            inputs *= 2 if self.fp4_group else 1      # already FP4 (in other groups): two a byte
            if inputs % group or group % 2:
                raise ValueError(f"FP4 experts: {name}'s {inputs} inputs are not whole groups of {group}")
            setattr(self, name, nn.Parameter(torch.zeros(experts, rows, inputs // 2, dtype=torch.uint8, device=device),
                                             requires_grad=False))
            setattr(self, self.exponents_name(name),
                    torch.full((experts, rows, inputs // group), fp4.UE8M0_BIAS, dtype=torch.uint8, device=device))
        self.fp4_group = group

    @torch.no_grad()
    def to_fp4(self, group: int) -> None:
        """Replace the (loaded) dense experts by FP4 codes and exponents (fp4.quantize), one
        expert at a time so no float32 copy of every expert exists at once."""
        if self.fp4_group is not None:
            return
        dense = {name: getattr(self, name).data for name in ("gate_up_proj", "down_proj")}
        self.as_fp4(group)
        for name, weight in dense.items():
            codes, exps = getattr(self, name), getattr(self, self.exponents_name(name))
            for expert in range(weight.shape[0]):
                codes[expert], exps[expert] = fp4.quantize(weight[expert], group)

    @staticmethod
    def exponents_name(name: str) -> str:
        """The FP4 exponents' buffer of gate_up_proj / down_proj."""
        return name.replace("_proj", "_exps")

    def expert_weight(self, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s gate_up_proj or down_proj in `dtype` (dequantized when FP4)."""
        weight = getattr(self, name)[expert]
        if self.fp4_group is None:
            return weight
        return fp4.dequantize(weight, getattr(self, self.exponents_name(name))[expert], dtype)

    def local_expert(self, expert: int) -> int | None:
        """This rank's index of checkpoint expert `expert`; None when another rank holds it (an
        index past every expert stays as it is, for the loader to report)."""
        if not self.expert_parallel or expert >= self.num_experts:
            return expert
        local = expert - self.first_expert
        return local if 0 <= local < self.num_local else None

    def rank_part(self, tensor: torch.Tensor, part: str) -> torch.Tensor:
        """This rank's part of a whole checkpoint tensor: `part` "gate_up_proj" / "down_proj"
        (stacked [E, ...] or one expert's down [hidden, I]) or "gate" / "up" (one expert's half,
        [I, hidden])."""
        if self.group.size == 1:
            return tensor
        if self.expert_parallel:   # whole experts; one expert's tensors arrive already chosen
            stacked = tensor.dim() == 3
            return tensor[self.first_expert:self.first_expert + self.num_local] if stacked else tensor
        rows = rank_rows(self.inner, self.group)
        if part == "down_proj":
            return tensor[..., rows]
        if part == "gate_up_proj":   # [gate rows; up rows]: this rank's rows of each
            return torch.cat([tensor[..., rows, :], tensor[..., self.inner:, :][..., rows, :]], dim=-2)
        return tensor[..., rows, :]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        grouped = fp4_grouped_supported(x) if self.fp4_group is not None else grouped_mm_supported(x)
        if self.grouped and grouped:
            return self.forward_grouped(x, ids, weights)
        return self.forward_loop(x, ids, weights)

    def forward_grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every routed expert in two grouped GEMMs: the (token, slot) pairs sorted by expert,
        each expert's rows one group (counts per expert). No host sync, whatever the routing, so
        it also fits a CUDA graph. torch's grouped GEMM for dense experts; for FP4 experts the
        Triton kernel that reads their codes (layers/quantization/fp4_moe_triton.py). On V4's
        Triton path a decode-sized step sorts and combines in two kernels (triton_moe.py)."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        num_experts = self.gate_up_proj.shape[0]
        fp4_config = None
        if self.fp4_group is not None:
            from deepinfer.layers.quantization import fp4_moe_triton as kernels

            fp4_config = kernels.default_config(flat.shape[0], num_experts)
        fused = current_backend().fused_v4_ops and 0 < flat.shape[0] <= FUSED_DISPATCH_PAIRS
        if fused:
            from deepinfer.models.deepseek_v4 import triton_moe

            dispatch = triton_moe.align(ids, num_experts, fp4_config.block_m if fp4_config else 1)
            token, counts, offs = dispatch.token, dispatch.counts, dispatch.ends
            tiles = kernels.ExpertTiles(dispatch.starts, dispatch.ends, dispatch.tile_ends) if fp4_config else None
        else:
            order = torch.argsort(flat, stable=True)
            token = order // k
            # Counted by index_add_, not bincount (which sizes its output from the largest id: a host sync).
            counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
            counts.index_add_(0, flat, torch.ones_like(flat))
            offs = counts.cumsum(0).to(torch.int32)
            tiles = kernels.expert_tiles(counts, fp4_config.block_m) if fp4_config else None
        if fp4_config is None:
            gate, up = torch._grouped_mm(x[token], self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            y = torch._grouped_mm(clamped_swiglu(gate, up, self.limit), self.down_proj.transpose(1, 2), offs=offs)
        elif (fp4_config.block_m >= PREFILL_ROWS and not torch.cuda.is_current_stream_capturing()
              and grouped_mm_supported(x)):
            # A prefill: bf16 grouped GEMMs over experts dequantized a chunk at a time.
            gate, up = kernels.fp4_grouped_mm_dequantized(x[token], self.gate_up_proj, self.gate_up_exps,
                                                          counts).chunk(2, dim=-1)
            y = kernels.fp4_grouped_mm_dequantized(clamped_swiglu(gate, up, self.limit), self.down_proj,
                                                   self.down_exps, counts)
        else:
            gate, up = kernels.fp4_grouped_mm(x[token], self.gate_up_proj, self.gate_up_exps, counts, fp4_config,
                                              tiles).chunk(2, dim=-1)
            y = kernels.fp4_grouped_mm(clamped_swiglu(gate, up, self.limit), self.down_proj, self.down_exps,
                                       counts, fp4_config, tiles)
        if fused:
            return triton_moe.combine(y, dispatch.pos, weights, x.dtype)
        if flat.shape[0] >= GATHER_COMBINE_ROWS:
            # Each token's k rows back in slot order, weighted and summed: a gather and a sum,
            # where index_add_'s atomic adds of 16-bit rows were slow at a prefill's size.
            slot_order = torch.empty_like(order)
            slot_order[order] = torch.arange(order.shape[0], device=order.device)
            rows = y[slot_order].view(x.shape[0], k, -1)
            return (rows * weights.to(rows.dtype)[..., None]).sum(dim=1).to(x.dtype)
        y = y * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))

    def forward_loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The reference: one pair of matmuls per expert that has tokens (FP4 experts dequantized
        one at a time)."""
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            token, slot = torch.nonzero(ids == expert, as_tuple=True)
            gate, up = F.linear(x[token], self.expert_weight("gate_up_proj", expert, x.dtype)).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), self.expert_weight("down_proj", expert, x.dtype))
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out


class V4MoE(nn.Module):
    def __init__(self, cfg: V4Config, mlp_type: str) -> None:
        super().__init__()
        self.tp = current_tp_group()
        check_group(cfg, self.tp)
        # The router is replicated: every rank routes the same tokens to the same experts.
        self.gate = Router(cfg, hashed=mlp_type == "hash_moe")
        self.experts = RoutedExperts(cfg, self.tp)
        # Expert parallelism keeps the shared expert whole on every rank (parallel.py).
        shared_group = ParallelGroup() if self.experts.expert_parallel else self.tp
        self.shared_experts = SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit,
                                           shared_group)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.experts.expert_parallel:   # routing, dispatch and combine: parallel.py
            ids = None if token_ids is None else token_ids.reshape(-1)
            out = expert_parallel_moe(flat, ids, self.gate, self.experts, self.shared_experts, self.tp)
            return out.view_as(x)
        ids, weights = self.gate(flat, token_ids)
        # Tensor parallelism: each rank's partial sums of the routed and shared experts, reduced
        # once (a no-op on one rank).
        return self.tp.all_reduce((self.experts(flat, ids, weights) + self.shared_experts(flat)).view_as(x))
