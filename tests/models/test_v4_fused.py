"""DeepSeek-V4's fused ops on its Triton path against their PyTorch references: mHC's stream
mixing (triton_hyper.py vs hyper.py), the rope (triton_rope.py vs rope.py), the two norms
(layers/fused/rms_norm.py vs norm.py), the clamped SwiGLU (layers/fused/activation.py vs
moe.py), the router (triton_router.py vs moe.Router) and the MoE's dispatch and combine
(triton_moe.py vs RoutedExperts.forward_grouped's PyTorch ops). Stream counts that are and are not
powers of two, token counts around the kernels' blocks, float32 (to the summation order) and
bf16 (within its rounding). The whole model on this path is checked against transformers by
test_deepseek_v4_kernels.py. Runs on a GPU, or on the CPU under Triton's interpreter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.triton_support import DEVICE, INTERPRETED  # skips this module without a way to run Triton

LOW = torch.float16 if INTERPRETED else torch.bfloat16
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), LOW: dict(atol=2e-2, rtol=2e-2)}

# The kernel modules import triton: only after the skip above.
from deepinfer.layers.fused.activation import gated_act  # noqa: E402
from deepinfer.layers.fused.rms_norm import rms_norm  # noqa: E402
from deepinfer.layers.quantization.fp4_moe_triton import expert_tiles  # noqa: E402
from deepinfer.models.deepseek_v4 import triton_hyper, triton_moe, triton_rope, triton_router  # noqa: E402
from deepinfer.models.deepseek_v4.hyper import HyperConnection, HyperHead  # noqa: E402
from deepinfer.models.deepseek_v4.moe import Router, clamped_swiglu  # noqa: E402
from deepinfer.models.deepseek_v4.norm import V4RMSNorm, unit_rms  # noqa: E402
from deepinfer.models.deepseek_v4.rope import V4Rotary  # noqa: E402


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0))
    return module.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
@pytest.mark.parametrize("streams,hidden,tokens", [(4, 64, 1), (3, 96, 17), (2, 32, 5)])
def test_hyper_connection_matches_its_reference(streams, hidden, tokens, dtype):
    hc = randomized(HyperConnection(hidden, streams, iters=20, eps=1e-6, norm_eps=1e-6), streams + hidden)
    x = torch.randn(1, tokens, streams, hidden, device=DEVICE).to(dtype)
    want = hc(x)   # outside a forward: the reference
    got = triton_hyper.hc_pre(x, hc.fn, hc.base, hc.scale, hc.eps, hc.norm_eps, hc.iters)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), **TOL[dtype])
    block_in, post, comb = want
    out = torch.randn(1, tokens, hidden, device=DEVICE).to(dtype)
    torch.testing.assert_close(triton_hyper.hc_merge(x, out, post, comb).float(),
                               HyperConnection.merge(x, out, post, comb).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
def test_hyper_head_matches_its_reference(dtype):
    head = randomized(HyperHead(48, 3, eps=1e-6, norm_eps=1e-6), 3)
    x = torch.randn(1, 7, 3, 48, device=DEVICE).to(dtype)
    got = triton_hyper.hc_head(x, head.hc_fn, head.hc_base, head.hc_scale, head.eps, head.norm_eps)
    torch.testing.assert_close(got.float(), head(x).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
def test_hyper_mixing_of_a_long_step(dtype):
    """A prefill-sized step (the mixing's tall token blocks, 16-bit streams through TF32x3 dots)."""
    hc = randomized(HyperConnection(32, 4, iters=20, eps=1e-6, norm_eps=1e-6), 5)
    x = torch.randn(1, triton_hyper.LONG_STEP + 3, 4, 32, device=DEVICE).to(dtype)
    for g, w in zip(triton_hyper.hc_pre(x, hc.fn, hc.base, hc.scale, hc.eps, hc.norm_eps, hc.iters), hc(x)):
        torch.testing.assert_close(g.float(), w.float(), **TOL[dtype])


def test_hyper_mixing_splits_long_rows():
    """Rows of 4 x 4096 inputs: the projection split over many programs, summed back."""
    hc = randomized(HyperConnection(4096, 4, iters=20, eps=1e-6, norm_eps=1e-6), 0)
    x = torch.randn(1, 2, 4, 4096, device=DEVICE)
    for g, w in zip(triton_hyper.hc_pre(x, hc.fn, hc.base, hc.scale, hc.eps, hc.norm_eps, hc.iters), hc(x)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
@pytest.mark.parametrize("heads,dim,rope_dim", [(20, 48, 16), (1, 64, 64), (3, 24, 8)])
def test_rope_matches_its_reference(heads, dim, rope_dim, dtype, inverse):
    params = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
              "attention_factor": 1.2}
    rotary = V4Rotary(rope_dim, params).to(DEVICE)
    x = torch.randn(1, 9, heads, dim, device=DEVICE).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 300, 4095, 70000], device=DEVICE)
    got = triton_rope.rotate(x, rotary.cos_sin(positions), inverse)
    want = rotary.rotate(x, positions, inverse)
    assert got.dtype == dtype
    if dtype == torch.float32:   # the same float32 ops (a GPU may fuse a product and a sum)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
def test_norms_match_their_references(dtype):
    norm = randomized(V4RMSNorm(40, 1e-6), 1)
    x = torch.randn(3, 5, 40, device=DEVICE).to(dtype)
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps).float(), norm(x).float(), **TOL[dtype])
    heads = torch.randn(1, 5, 4, 40, device=DEVICE).to(dtype)
    torch.testing.assert_close(rms_norm(heads, None, 1e-6).float(), unit_rms(heads, 1e-6).float(), **TOL[dtype])


@pytest.mark.parametrize("limit", [0.0, 1.5])
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
def test_clamped_swiglu_matches_its_reference(dtype, limit):
    gate_up = (torch.randn(6, 2, 80, device=DEVICE) * 3).to(dtype)
    gate, up = gate_up[:, 0], gate_up[:, 1]   # rows strided over both halves
    got = gated_act(gate, up, "silu", limit)
    torch.testing.assert_close(got.float(), clamped_swiglu(gate, up, limit).float(), **TOL[dtype])


@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_router_matches_its_reference(func, hashed):
    cfg = SimpleNamespace(experts_per_token=6, scoring_func=func, routed_scaling_factor=1.5, num_experts=40,
                          hidden_size=24, vocab_size=50)
    router = Router(cfg, hashed=hashed)
    g = torch.Generator().manual_seed(len(func) + hashed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hashed:
            router.tid2eid.copy_(torch.stack([torch.randperm(40, generator=g)[:6] for _ in range(50)]))
        else:
            router.e_score_correction_bias.copy_(torch.randn(40, generator=g) * 0.1)
    router = router.to(DEVICE)
    x = torch.randn(9, 24, generator=g).to(DEVICE)
    token_ids = torch.randint(0, 50, (9,), generator=g).to(DEVICE)
    want_ids, want_w = router(x, token_ids)
    logits = torch.nn.functional.linear(x, router.weight)
    ids, w = triton_router.route(logits, func, 6, 1.5, None if hashed else router.e_score_correction_bias,
                                 router.tid2eid if hashed else None, token_ids)
    # The same experts (in any order) with the same weights.
    order, want_order = ids.sort(dim=1), want_ids.sort(dim=1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens,k,experts,block_m", [(1, 6, 256, 1), (1, 6, 96, 16), (13, 2, 16, 16),
                                                     (64, 6, 256, 16), (170, 6, 40, 128)])
def test_moe_dispatch_matches_its_reference(tokens, k, experts, block_m):
    """align against forward_grouped's PyTorch ops: the stable sort by expert, the counts, the
    tiles; tokens sharing experts, and experts with no rows."""
    g = torch.Generator().manual_seed(tokens * k + experts)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(DEVICE)
    if tokens > 1:   # some experts picked by many tokens, some by none
        ids[: tokens // 2] = ids[0]
    got = triton_moe.align(ids, experts, block_m)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=DEVICE).index_add_(0, flat, torch.ones_like(flat))
    assert torch.equal(got.counts, counts)
    assert torch.equal(got.token, order // k)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.shape[0], device=DEVICE)
    assert torch.equal(got.pos, pos)
    for have, want in zip((got.starts, got.ends, got.tile_ends), expert_tiles(counts, block_m)):
        assert torch.equal(have, want)


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
def test_moe_combine_matches_its_reference(dtype):
    """combine against the reference's weighting and index_add_ (float32 sums: bf16 within its
    rounding of the sum)."""
    g = torch.Generator().manual_seed(3)
    tokens, k, hidden = 5, 6, 1100
    ids = torch.stack([torch.randperm(20, generator=g)[:k] for _ in range(tokens)]).to(DEVICE)
    dispatch = triton_moe.align(ids, 20, 1)
    rows = torch.randn(tokens * k, hidden, generator=g).to(DEVICE, dtype)
    weights = torch.rand(tokens, k, generator=g).to(DEVICE, dtype)
    order = torch.argsort(ids.reshape(-1), stable=True)
    want = torch.zeros(tokens, hidden, dtype=torch.float32, device=DEVICE).index_add_(
        0, order // k, (rows * weights.reshape(-1)[order, None]).float())
    got = triton_moe.combine(rows, dispatch.pos, weights, dtype)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("tokens", [1, 7, 100])
def test_experts_on_the_fused_dispatch_match_the_loop(tokens, monkeypatch):
    """RoutedExperts.forward_grouped in a forward of V4's Triton path (align and combine around
    the grouped products) against the reference loop over experts, float32."""
    pytest.importorskip("transformers")
    from test_deepseek_v4_moe import random_experts

    from deepinfer.layers.attention import forward_context
    from deepinfer.models.deepseek_v4.paged_kernels import V4KernelStepBackend

    align = triton_moe.align
    cfg, experts, g = random_experts(tokens)
    experts = experts.to(DEVICE)
    x = torch.randn(tokens, cfg.hidden_size, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(cfg.num_experts - 1, generator=g)[:cfg.experts_per_token]
                       for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, cfg.experts_per_token, generator=g).to(DEVICE)
    calls = []
    monkeypatch.setattr(triton_moe, "align", lambda *a: calls.append(a) or align(*a))
    with forward_context(SimpleNamespace(backend=V4KernelStepBackend(torch.device(DEVICE)))):
        got = experts.forward_grouped(x, ids, weights)
    assert len(calls) == 1   # the fused dispatch ran
    torch.testing.assert_close(got, experts.forward_loop(x, ids, weights), **TOL[torch.float32])
