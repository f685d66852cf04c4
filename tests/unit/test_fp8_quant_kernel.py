"""The activations' FP8 quantization kernel (layers/quantization/fp8_quant_triton.py) against its
PyTorch reference (fp8.quantize_rows_reference): the same codes and scales, bit for bit, per row
and per 128 inputs, on ragged shapes and on rows of zeros. FP8 stores need a GPU: Triton's
interpreter runs on NumPy, which has no float8."""

from __future__ import annotations

import pytest
import torch

from tests.triton_support import DEVICE, INTERPRETED  # skips this module without a way to run Triton

pytestmark = pytest.mark.skipif(INTERPRETED, reason="the interpreter runs on NumPy, which has no float8")

from deepinfer.layers.quantization import fp8  # noqa: E402


@pytest.mark.parametrize("group", [None, 128], ids=["per-row", "per-128"])
@pytest.mark.parametrize("rows,cols", [(1, 4096), (7, 384), (300, 14336), (64, 1024)])
def test_kernel_gives_the_reference_codes_and_scales(rows, cols, group):
    torch.manual_seed(rows + cols)
    x = (torch.randn(rows, cols, device=DEVICE) * torch.logspace(-3, 2, cols, device=DEVICE)).to(torch.bfloat16)
    x[0, : cols // 2] = 0   # a zero group: the smallest scale, zero codes
    codes, scales = fp8.quantize_rows(x, group)
    want_codes, want_scales = fp8.quantize_rows_reference(x, group)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


def test_strided_rows_and_bad_groups():
    x = torch.randn(5, 512, device=DEVICE).to(torch.bfloat16)[:, :256]
    codes, scales = fp8.quantize_rows(x, 128)
    want_codes, want_scales = fp8.quantize_rows_reference(x, 128)
    assert torch.equal(scales, want_scales) and torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    with pytest.raises(ValueError, match="whole groups of 128"):
        fp8.quantize_rows(torch.randn(2, 200, device=DEVICE), 128)
