"""Random weights of a real DeepSeek-V4 shape (load_format="dummy"), in the formats the model
holds them in: what speed measurements and `deepinfer serve --load-format dummy` run on.

The layers' own init leaves V4 degenerate: FP8 codes, FP4 codes, the router's weight and the
hash layers' token -> expert tables all start at zero, so every token would be routed to the
same few experts and a batch would read a handful of expert weights instead of most of them
(a decode batch's real cost). Drawn here instead:
  - matrices: normal, std 0.02; norm weights 1;
  - FP8 projections: the codes and block scales of such normal weights (fp8.quantize_blocks);
  - FP4 experts: uniform e2m1 codes (rms 2.93) at the scale 2^-7, std 0.023, near the others';
  - hash tables: distinct experts per token, uniformly at random.
Everything is written in place, so tensors captured by CUDA graphs or shared with a drafter keep
their identity. The same seed gives the same weights on every engine of a shape.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.layers.linear import Linear
from deepinfer.layers.quantization import fp4, fp8

# 2^-7 per FP4 group: uniform e2m1 codes times this have about the std of the other weights.
FP4_DUMMY_EXPONENT = fp4.UE8M0_BIAS - 7
WEIGHT_STD = 0.02


@torch.no_grad()
def randomize(model: nn.Module, num_experts: int, seed: int = 0) -> None:
    from deepinfer.models.deepseek_v4.moe import RoutedExperts

    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    drawn: set[int] = set()
    for module in model.modules():
        if isinstance(module, Linear) and module.is_fp8:
            weight = torch.empty(module.weight.shape, device=device).normal_(0.0, WEIGHT_STD, generator=g)
            codes, scale = fp8.quantize_blocks(weight, module.weight_block)
            module.weight.copy_(codes)
            module.weight_scale.copy_(scale)
            drawn.add(id(module.weight))
        elif isinstance(module, RoutedExperts) and module.fp4_group is not None:
            for name in ("gate_up_proj", "down_proj"):
                codes, exponents = getattr(module, name), getattr(module, module.exponents_name(name))
                codes.copy_(torch.randint(0, 256, codes.shape, device=device, generator=g, dtype=torch.int32))
                exponents.fill_(FP4_DUMMY_EXPONENT)
                drawn.add(id(codes))
    for name, p in model.named_parameters():
        if id(p) in drawn:
            continue
        if name.endswith(("norm.weight", "layernorm.weight")):
            p.fill_(1.0)
        elif p.dim() >= 2:
            p.normal_(0.0, WEIGHT_STD, generator=g)
    for name, table in model.named_buffers():
        if name.endswith("tid2eid"):   # [vocab, k]: k distinct experts for each token
            scores = torch.rand(table.shape[0], num_experts, generator=g, device=table.device)
            table.copy_(scores.argsort(dim=-1)[:, :table.shape[1]])
