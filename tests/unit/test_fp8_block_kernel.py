"""The block-scaled FP8 Triton kernel (deepinfer/layers/quantization/fp8_block_triton.py) against the
dequantized reference: activations quantized per row and 128 inputs, weights per 128 x 128 block,
ragged shapes (masked rows and columns). FP8 needs a GPU with FP8 tensor cores (Hopper); under
Triton's interpreter, which has no FP8 dot, the same kernel runs on float16 codes (every e4m3 value
is one), which checks its tiling and scaling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_support import DEVICE, INTERPRETED  # skips this module without a way to run Triton

FP8_DOT = not INTERPRETED and torch.cuda.get_device_capability()[0] >= 9

# The kernel module imports triton: only after the skip above.
from deepinfer.layers.quantization import fp8  # noqa: E402
from deepinfer.layers.quantization.fp8_block_triton import block_fp8_mm  # noqa: E402

CASES = [(1, 256, 384), (24, 200, 256), (130, 512, 1024)] + ([] if INTERPRETED else [(7, 1536, 7168)])


@pytest.mark.parametrize("splits", [1, None, 3], ids=["whole", "chosen", "3-splits"])
@pytest.mark.parametrize("m,n,k", CASES)
def test_block_fp8_mm_matches_the_dequantized_reference(m, n, k, splits):
    """Whole inputs, split as the kernel chooses for the shape (decode shapes split), and in 3
    runs of input blocks (uneven where the blocks do not divide)."""
    torch.manual_seed(m + n + k)
    codes, scale = fp8.quantize_blocks(torch.randn(n, k, device=DEVICE) * 0.05, (128, 128))
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    xq, xs = fp8.quantize_rows(x, 128)
    if not FP8_DOT:   # the same values as float16 codes
        xq, codes = xq.to(torch.float16), codes.to(torch.float16)
    got = block_fp8_mm(xq, xs, codes, scale, torch.float16 if INTERPRETED else torch.bfloat16, splits).float()
    # The reference with the same activation rounding: exact up to float32 sums and the output's rounding.
    xr = (xq.float().view(m, -1, 128) * xs[..., None]).view(m, k)
    want = F.linear(xr, fp8.dequantize(codes.float(), scale, (128, 128), torch.float32))
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)


@pytest.mark.skipif(not FP8_DOT, reason="FP8 tensor cores: Hopper or later")
def test_a_linear_with_block_weights_runs_the_kernel_where_torch_has_none():
    from deepinfer.layers.linear import Linear

    assert fp8.block_product_available(torch.device(DEVICE))
    layer = Linear(512, 384, bias=False).to(DEVICE)
    codes, scale = fp8.quantize_blocks(torch.randn(384, 512, device=DEVICE) * 0.05, (128, 128))
    layer.as_fp8_blocks((128, 128))
    layer.weight.data.copy_(codes)
    layer.weight_scale.copy_(scale)
    x = torch.randn(5, 512, device=DEVICE).to(torch.bfloat16)
    assert fp8.blockwise_fast(x, layer.weight, (128, 128))
    got = layer(x).float()
    want = F.linear(x.float(), fp8.dequantize(codes, scale, (128, 128), torch.float32))
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("m", [1, 37])
def test_grouped_weight_multiplies_each_group_by_its_own_inputs(m):
    """groups > 1 (DeepSeek-V4's block-diagonal output projection, 4 groups of 256 rows over 384
    inputs here): x [m, groups * K], group g's outputs from its own K inputs only."""
    groups, per, k = 4, 256, 384
    torch.manual_seed(m)
    codes, scale = fp8.quantize_blocks(torch.randn(groups * per, k, device=DEVICE) * 0.05, (128, 128))
    x = torch.randn(m, groups * k, device=DEVICE).to(torch.bfloat16)
    xq, xs = fp8.quantize_rows(x, 128)
    if not FP8_DOT:
        xq, codes = xq.to(torch.float16), codes.to(torch.float16)
    got = block_fp8_mm(xq, xs, codes, scale, torch.float16 if INTERPRETED else torch.bfloat16, groups=groups).float()
    xr = (xq.float().view(m, -1, 128) * xs[..., None]).view(m, groups, k)
    w = fp8.dequantize(codes.float(), scale, (128, 128), torch.float32).view(groups, per, k)
    want = torch.einsum("mgi,goi->mgo", xr, w).reshape(m, -1)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="whole 128-blocks"):
        block_fp8_mm(xq[:, :k], xs[:, :3], codes, scale, torch.bfloat16, groups=groups)


@pytest.mark.skipif(not FP8_DOT, reason="FP8 tensor cores: Hopper or later")
@pytest.mark.parametrize("rows", [1, 6])
def test_v4_grouped_projection_in_fp8(rows):
    """V4's grouped output projection (attention.GroupedLinear) kept in FP8 blocks, outside a fused
    forward (so one row too runs the grouped kernel; the GEMV's grouped case is test_gemv.py's):
    its product and its reference path against the einsum of the dequantized weight."""
    from deepinfer.models.deepseek_v4.attention import GroupedLinear

    layer = GroupedLinear(512, 4 * 256, 4).to(DEVICE)
    layer.to_fp8_blocks((128, 128))
    x = torch.randn(rows, 4, 512, device=DEVICE).to(torch.bfloat16)
    w = fp8.dequantize(layer.weight, layer.weight_scale, (128, 128), torch.float32).view(4, 256, 512)
    want = torch.einsum("mgi,goi->mgo", x.float(), w)
    torch.testing.assert_close(layer(x).float(), want, atol=0.1, rtol=0.02)
    torch.testing.assert_close(fp8.fp8_grouped_linear(x, layer.weight, layer.weight_scale, (128, 128),
                                                      reference=True).float(), want, atol=0.02, rtol=0.02)
