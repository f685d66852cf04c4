"""FP4 e2m1 weights with ue8m0 group scales (deepinfer/layers/quantization/fp4.py): the codes decode
to the grid by hand, a quantized weight comes back within e2m1's rounding, the scales read from
every dtype a checkpoint stores them in, and FP4 routed experts run the reference loop on them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.layers.quantization import fp4


def test_codes_decode_by_hand():
    # Byte 0x21: code 1 (0.5) in the low nibble (column 0), code 2 (1.0) in the high one; 0xF8:
    # code 8 (-0.0) then code 15 (-6.0).
    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)
    assert fp4.unpack_e2m1(packed).tolist() == [[0.5, 1.0, -0.0, -6.0]]
    exps = torch.tensor([[127 + 1, 127 - 2]], dtype=torch.uint8)      # x2 for columns 0-1, x1/4 for 2-3
    assert fp4.dequantize(packed, exps).tolist() == [[1.0, 2.0, -0.0, -1.5]]


@pytest.mark.parametrize("dtype", ["uint8", "e8m0", "float32"])
def test_scales_read_from_each_stored_dtype(dtype):
    packed = torch.tensor([[0x21, 0x43]], dtype=torch.uint8)             # 0.5 1.0 | 1.5 2.0
    exps = torch.tensor([[129, 126]], dtype=torch.uint8)                 # x4, x0.5
    scale = {"uint8": exps, "e8m0": exps.view(torch.float8_e8m0fnu), "float32": fp4.multipliers(exps)}[dtype]
    assert fp4.dequantize(packed, scale).tolist() == [[2.0, 4.0, 0.75, 1.0]]


def test_float_scales_are_no_ue8m0_exponents():
    with pytest.raises(ValueError, match="ue8m0"):
        fp4.scale_exponents(torch.ones(2, 2))


def test_quantize_rounds_to_the_grid_within_its_step():
    torch.manual_seed(0)
    w = torch.randn(3, 16, 64) * torch.logspace(-4, 2, 16)[None, :, None]
    packed, exps = fp4.quantize(w, 32)
    assert packed.shape == (3, 16, 32) and exps.shape == (3, 16, 2) and packed.dtype == exps.dtype == torch.uint8
    back = fp4.dequantize(packed, exps)
    scale = fp4.multipliers(exps).repeat_interleave(32, dim=-1)
    # Every group's largest magnitude fits under 6 x its scale; the grid's widest step there is 2.
    assert (w.abs() <= 6 * scale).all()
    assert ((back - w).abs() <= scale).all()
    # A dequantized weight is on the grid: quantized again, it comes back exactly (its codes may
    # differ where a group's largest value fell to 3 x its scale, which is also 6 x half of it).
    assert torch.equal(fp4.dequantize(*fp4.quantize(back, 32)), back)


def test_fp4_experts_run_the_reference_loop():
    """RoutedExperts.as_fp4 + a loaded weight: the loop dequantizes the experts it uses."""
    from types import SimpleNamespace

    from deepinfer.models.deepseek_v4.moe import RoutedExperts

    cfg = SimpleNamespace(num_experts=4, hidden_size=64, moe_intermediate_size=32, swiglu_limit=7.0)
    experts = RoutedExperts(cfg)
    torch.manual_seed(1)
    dense = {"gate_up_proj": torch.randn(4, 64, 64), "down_proj": torch.randn(4, 64, 32)}
    experts.as_fp4(32)
    for name, w in dense.items():
        codes, exps = fp4.quantize(w, 32)
        getattr(experts, name).data.copy_(codes)
        getattr(experts, name.replace("_proj", "_exps")).copy_(exps)
    x = torch.randn(5, 64)
    ids = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 1], [0, 3]])
    weights = torch.rand(5, 2)
    got = experts(x, ids, weights)
    want = torch.zeros_like(x)
    for t in range(5):
        for slot in range(2):
            e = int(ids[t, slot])
            gate, up = F.linear(x[t], experts.expert_weight("gate_up_proj", e, torch.float32)).chunk(2)
            h = F.silu(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0)
            want[t] += weights[t, slot] * F.linear(h, experts.expert_weight("down_proj", e, torch.float32))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
