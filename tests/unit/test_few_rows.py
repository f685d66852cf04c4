"""The few-rows product (deepinfer/layers/fused/few_rows.py) against F.linear, its reference.

Every row count from 1 to 16, shapes of the small models and odd sizes that exercise the masked
N and K tails, with and without bias, several tile configurations. float32 within summation
order (tensor cores take float32 as tf32 on a GPU: a looser bound there), low precision within a
rounding. Runs on a GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_support import DEVICE, INTERPRETED  # skips this module without a way to run Triton

LOW = torch.float16 if INTERPRETED else torch.bfloat16

# The kernel module imports triton: only after the skip above.
from deepinfer.layers.fused.few_rows import MAX_ROWS, few_rows_matmul  # noqa: E402

SHAPES = [(1728, 576), (576, 1536), (640, 1024), (1000, 300), (40, 129)]
CONFIGS = [(16, 128, 4, 3), (32, 256, 4, 4), (64, 64, 4, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("n,k", SHAPES)
def test_few_rows_matches_linear(n, k, config, dtype):
    torch.manual_seed(n + k)
    weight = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    for rows in (1, 2, 5, 6, MAX_ROWS):
        x = torch.randn(rows, k, device=DEVICE).to(dtype)
        for b in (None, bias):
            ours = few_rows_matmul(x, weight, b, config=config)
            ref = F.linear(x.float(), weight.float(), None if b is None else b.float())
            assert ours.shape == (rows, n) and ours.dtype == dtype
            if dtype == torch.float32:
                bound = 1e-4 if INTERPRETED else 3e-2   # tf32 on a GPU's tensor cores
            else:
                bound = 3e-2
            torch.testing.assert_close(ours.float(), ref, atol=bound, rtol=bound)


def test_few_rows_refuses_what_it_cannot_take():
    weight = torch.zeros(64, 32, device=DEVICE)
    with pytest.raises(ValueError, match="1 <= M <= 16"):
        few_rows_matmul(torch.zeros(MAX_ROWS + 1, 32, device=DEVICE), weight, config=CONFIGS[0])
    with pytest.raises(ValueError, match="no few-rows configuration"):
        few_rows_matmul(torch.zeros(2, 32, device=DEVICE), weight)
