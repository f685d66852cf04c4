"""The one-row decode GEMV (deepinfer/layers/fused/gemv.py) against F.linear, its reference.

Shapes: the projections of SmolLM2-135M, Gemma 3 270M and Llama-3-8B, plus odd sizes that
exercise the masked tails; with and without bias; every tile configuration the table can hand
out. float32 tightly (summation order only), low precision within a rounding.
Runs on a GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_support import DEVICE, INTERPRETED  # skips this module without a way to run Triton

LOW = torch.float16 if INTERPRETED else torch.bfloat16

# The kernel module imports triton: only after the skip above.
from deepinfer.layers.fused.gemv import DEFAULT_CONFIG, TUNED, gemv, gemv_config  # noqa: E402

SHAPES = [(1728, 576), (576, 576), (3072, 576), (576, 1536),   # SmolLM2-135M: qkv, o, gate_up, down
          (1536, 640), (640, 1024), (4096, 640),                # Gemma 3 270M
          (6144, 4096), (4096, 14336),                          # Llama-3-8B qkv, down
          (1000, 300), (7, 129)]                                # odd: masked N and K tails


def tol(dtype: torch.dtype, k: int) -> dict:
    if dtype == torch.float32:
        return {"atol": 1e-5 * k ** 0.5, "rtol": 1e-5}
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 2e-3, "rtol": 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_linear(n, k, dtype):
    if INTERPRETED and n * k > 4096 * 4096:
        pytest.skip("too slow under the interpreter")
    torch.manual_seed(n + k)
    weight = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    for b in (None, bias):
        expected = F.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
        out = gemv(x, weight, b)
        assert out.shape == (1, n) and out.dtype == dtype
        torch.testing.assert_close(out.float(), expected.float(), **tol(dtype, k))


@pytest.mark.parametrize("config", sorted(set(TUNED.values()) | {DEFAULT_CONFIG, (8, 512, 8), (2, 1024, 4)}))
def test_every_tile_configuration(config):
    """Each configuration the table may hand out, on a shape with tails in both dims."""
    torch.manual_seed(0)
    n, k = 203, 1100
    weight = torch.randn(n, k, device=DEVICE)
    x = torch.randn(1, k, device=DEVICE)
    torch.testing.assert_close(gemv(x, weight, config=config), F.linear(x, weight), **tol(torch.float32, k))


def test_bad_input():
    weight = torch.randn(64, 128, device=DEVICE)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.randn(2, 128, device=DEVICE), weight)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.randn(1, 100, device=DEVICE), weight)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.randn(1, 256, device=DEVICE)[:, ::2], weight)


def test_strip_never_much_longer_than_k():
    assert gemv_config(4096, 4096) == DEFAULT_CONFIG
    assert gemv_config(7, 129)[1] == 256 and gemv_config(576, 576)[1] == 1024


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs on NumPy, which has no float8")
@pytest.mark.parametrize("blocks", [False, True], ids=["per-channel", "128x128 blocks"])
@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 2048), (300, 1000)])
def test_fp8_weights_match_their_dequantized_product(n, k, blocks):
    """FP8 codes with their scales (fp8.py's two layouts) against F.linear on the dequantized weight."""
    from deepinfer.layers.quantization import fp8

    torch.manual_seed(n + k)
    weight = torch.randn(n, k, device=DEVICE) * 0.05
    codes, scale = fp8.quantize_blocks(weight, (128, 128)) if blocks else fp8.quantize_per_channel(weight)
    block = (128, 128) if blocks else None
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    want = F.linear(x.float(), fp8.dequantize(codes, scale, block, torch.float32))
    got = gemv(x, codes, scale=scale, block=block)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("groups,per,k", [(8, 64, 256), (2, 12, 129)])
def test_grouped_weight_multiplies_each_group_by_its_own_row(groups, per, k):
    """groups > 1 (DeepSeek-V4's block-diagonal output projection): group g's rows of the weight
    times x[g] only, against the einsum of the reference path."""
    torch.manual_seed(groups * k)
    weight = torch.randn(groups * per, k, device=DEVICE)
    x = torch.randn(groups, k, device=DEVICE)
    want = torch.einsum("gi,goi->go", x, weight.view(groups, per, k)).reshape(1, -1)
    got = gemv(x, weight, groups=groups, config=(4, 64, 2))
    torch.testing.assert_close(got, want, **tol(torch.float32, k))
    with pytest.raises(ValueError, match="a row per group"):
        gemv(x[:1], weight, groups=groups)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs on NumPy, which has no float8")
def test_grouped_fp8_blocks_match_their_dequantized_product():
    """V4-Flash's wo_a shape (8 groups of 1024 rows over 4096 inputs) in FP8 128 x 128 blocks."""
    from deepinfer.layers.quantization import fp8

    torch.manual_seed(8)
    groups, per, k = 8, 1024, 4096
    codes, scale = fp8.quantize_blocks(torch.randn(groups * per, k, device=DEVICE) * 0.05, (128, 128))
    x = torch.randn(groups, k, device=DEVICE).to(torch.bfloat16)
    w = fp8.dequantize(codes, scale, (128, 128), torch.float32).view(groups, per, k)
    want = torch.einsum("gi,goi->go", x.float(), w).reshape(1, -1)
    got = gemv(x, codes, scale=scale, block=(128, 128), groups=groups)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
