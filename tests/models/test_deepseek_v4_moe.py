"""DeepSeek-V4's routed experts: the grouped-GEMM path (torch._grouped_mm, what the engine runs)
against the reference loop over experts, with uneven routing (experts with no tokens, one
expert with most), on the CPU in float32 and bf16 and on CUDA in bf16."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models.deepseek_v4.config import V4Config
from deepinfer.models.deepseek_v4.moe import RoutedExperts, grouped_mm_supported

pytest.importorskip("transformers")
from test_deepseek_v4_layers import make_config  # noqa: E402

DEVICES = [("cpu", torch.float32), ("cpu", torch.bfloat16)]


def random_experts(seed: int) -> tuple[V4Config, RoutedExperts, torch.Generator]:
    """The r4_16 config's routed experts with random weights, and the generator, seeded, for the
    test's inputs."""
    cfg = V4Config.from_hf(make_config("r4_16").to_dict())
    g = torch.Generator().manual_seed(seed)
    experts = RoutedExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.3)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.3)
    return cfg, experts, g
if torch.cuda.is_available():
    DEVICES.append(("cuda", torch.bfloat16))


@pytest.mark.parametrize("device,dtype", DEVICES, ids=[f"{d}-{str(t)[6:]}" for d, t in DEVICES])
@pytest.mark.parametrize("tokens", [1, 7, 130, 2100])   # 2100 x 2 picks: combined by a gather
def test_grouped_experts_match_the_loop(device, dtype, tokens):
    cfg, experts, g = random_experts(tokens)
    experts = experts.to(device=device, dtype=dtype)
    x = torch.randn(tokens, cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    # Expert 0 takes most rows, the last expert none.
    ids = torch.randint(0, cfg.num_experts - 1, (tokens, cfg.experts_per_token), generator=g)
    ids[: tokens // 2, 0] = 0
    ids = ids.to(device)
    weights = torch.rand(tokens, cfg.experts_per_token, generator=g).to(device)
    assert grouped_mm_supported(x)
    want = experts.forward_loop(x, ids, weights)
    got = experts.forward_grouped(x, ids, weights)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@torch.no_grad()
def test_a_lora_adapter_on_the_shared_experts_down_proj_is_applied():
    """LoRASlots gives the shared expert's down_proj a stack (it is a projection an adapter may
    target): the MoE's output under the adapter's slot is the base output plus that projection's
    LoRA product of its input, and the base output without one."""
    from deepinfer.lora.adapter import LoRAAdapter
    from deepinfer.lora.slots import LoRASlots, step_rows
    from deepinfer.models.deepseek_v4.moe import V4MoE, clamped_swiglu

    cfg = V4Config.from_hf(make_config("r4_16").to_dict())
    g = torch.Generator().manual_seed(0)
    moe = V4MoE(cfg, "moe")
    for p in moe.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    slots = LoRASlots(moe, max_loras=1, max_rank=4)
    assert "shared_experts.down_proj" in slots.layout
    shared = moe.shared_experts
    a = torch.randn(4, shared.down_proj.in_features, generator=g)
    b = torch.randn(shared.down_proj.out_features, 4, generator=g)
    slots.place(1, LoRAAdapter("sd", "/sd", 4, 1.0, {"shared_experts.down_proj": (a, b)}))
    x = torch.randn(5, cfg.hidden_size, generator=g)
    with step_rows(None):
        base = moe(x)
    with step_rows(1):
        adapted = moe(x)
    h = clamped_swiglu(shared.gate_proj(x), shared.up_proj(x), shared.limit)
    torch.testing.assert_close(adapted - base, (h @ a.T) @ b.T, atol=1e-4, rtol=1e-4)
