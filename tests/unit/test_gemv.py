"""The one-row decode GEMV (deepinfer/layers/fused/gemv.py) against F.linear, its reference, and
its fusions (norm_gemv, act=) against the ops they replace: RMSNorm with the residual add, then
F.linear, then act(gate) * up.

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
from deepinfer.layers.fused.gemv import DEFAULT_CONFIG, TUNED, gemv, gemv_config, norm_gemv  # noqa: E402

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


def reference_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up of a gate_up row already rounded to its dtype, as GatedMLP's reference path."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return (gate * up).to(gate_up.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("n,k", [(3072, 576), (4096, 640), (2 * 203, 1100), (2 * 7, 129)])
def test_gated_gemv_matches_linear_then_act(n, k, act, dtype):
    torch.manual_seed(n + k)
    weight = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    for b in (None, bias):
        gate_up = F.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
        out = gemv(x, weight, b, act=act)
        assert out.shape == (1, n // 2) and out.dtype == dtype
        torch.testing.assert_close(out.float(), reference_act(gate_up, act).float(), **tol(dtype, k))


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n,k", [(1728, 576), (3072, 576), (2 * 203, 1100)])
def test_norm_gemv_matches_norm_then_linear(n, k, with_residual, act, dtype):
    """rms_norm(residual + x) * w, then the product (and act): the new residual stream bit for
    bit (the sum rounded to x's dtype, as the reference adds), the product within a rounding (the
    reference rounds the normalised row first), and the residual given left as it was."""
    torch.manual_seed(n * 3 + k)
    weight = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    x = (3 * torch.randn(1, k, device=DEVICE)).to(dtype)
    residual = torch.randn(1, k, device=DEVICE).to(dtype) if with_residual else None
    before = None if residual is None else residual.clone()
    eps = 1e-5
    row = x if residual is None else (residual + x)
    normed = F.rms_norm(row.float(), (k,), norm_weight.float(), eps).to(dtype)
    expected = F.linear(normed.float(), weight.float(), bias.float()).to(dtype)
    if act is not None:
        expected = reference_act(expected, act)
    out, new_residual = norm_gemv(x, residual, norm_weight, eps, weight, bias, act=act)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), **tol(dtype, k))
    assert torch.equal(new_residual, row)
    if residual is not None:
        assert torch.equal(residual, before)


def test_norm_gemv_gemma_offset():
    """Gemma's convention scales by 1 + w: norm_offset=1.0."""
    torch.manual_seed(5)
    k, n = 640, 256
    weight, norm_weight = torch.randn(n, k, device=DEVICE) / k ** 0.5, 0.1 * torch.randn(k, device=DEVICE)
    x = torch.randn(1, k, device=DEVICE)
    expected = F.linear(F.rms_norm(x, (k,), 1.0 + norm_weight, 1e-6), weight)
    out, _ = norm_gemv(x, None, norm_weight, 1e-6, weight, norm_offset=1.0)
    torch.testing.assert_close(out, expected, **tol(torch.float32, k))


def test_fusions_bad_input():
    weight = torch.randn(63, 128, device=DEVICE)
    x = torch.randn(1, 128, device=DEVICE)
    with pytest.raises(ValueError, match="even number of weight rows"):
        gemv(x, weight, act="silu")
    with pytest.raises(ValueError, match="not supported"):
        gemv(x, weight, act="relu")
    with pytest.raises(ValueError, match="residual"):
        norm_gemv(x, torch.randn(1, 64, device=DEVICE), torch.ones(128, device=DEVICE), 1e-5, weight)
