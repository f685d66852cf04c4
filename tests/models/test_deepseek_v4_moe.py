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
