"""The FP4 grouped MoE kernel (deepinfer/layers/quantization/fp4_moe_triton.py) against its
reference: each expert's rows times its dequantized weight (fp4.dequantize), F.linear.

Experts with no rows, with fewer rows than a tile and with several tiles; output widths that are
not a multiple of the tile (masked columns). float32 to the summation order (the weights are
exact e2m1 values times powers of two), bf16 within its rounding.
Runs on a GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_support import DEVICE, INTERPRETED  # skips this module without a way to run Triton

LOW = torch.float16 if INTERPRETED else torch.bfloat16

# The kernel module imports triton: only after the skip above.
from deepinfer.layers.quantization import fp4  # noqa: E402
from deepinfer.layers.quantization.fp4_moe_triton import TileConfig, fp4_grouped_mm  # noqa: E402

# Both ways to multiply (a one-row GEMV of float32 multiply-adds, tensor-core dots), with short and
# tall tiles; None: the tiling the kernel picks from the shapes.
# Split K: float32 partial sums of runs of the inputs, added after (two runs; four where K allows).
CONFIGS = {"default": None, "gemv": TileConfig(1, 32, 64, dot=False), "gemv-long-k": TileConfig(1, 16, 256, dot=False),
           "dot-16": TileConfig(16, 64, 128, dot=True), "dot-64": TileConfig(64, 32, 64, dot=True),
           "gemv-split-k": TileConfig(1, 32, 32, dot=False, split_k=4),
           "dot-split-k": TileConfig(16, 64, 64, dot=True, split_k=2),
           "dot-group-scales": TileConfig(16, 64, 128, dot=True, group_scales=True),
           "dot-bf16-ptx": TileConfig(16, 64, 128, dot=True, group_scales=True, bf16_ptx=True)}


def reference(x: torch.Tensor, codes: torch.Tensor, exps: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out, start = [], 0
    for e, n in enumerate(counts):
        w = fp4.dequantize(codes[e], exps[e], torch.float32)
        out.append(F.linear(x[start:start + n].float(), w))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, LOW], ids=str)
@pytest.mark.parametrize("counts,n,k", [([3, 0, 21, 1], 96, 256),    # an expert without rows; one of 2 tiles
                                        ([16, 16], 64, 128),         # whole tiles
                                        ([5, 40, 0, 0, 7], 70, 128),   # masked columns
                                        ([150, 0, 70], 64, 128)])    # prefill-sized: 64-row tiles
def test_fp4_grouped_mm_matches_the_dequantized_reference(counts, n, k, dtype, config):
    torch.manual_seed(sum(counts) + n + k)
    experts = len(counts)
    codes, exps = fp4.quantize(torch.randn(experts, n, k, device=DEVICE), 32)
    x = torch.randn(sum(counts), k, device=DEVICE).to(dtype)
    got = fp4_grouped_mm(x, codes, exps, torch.tensor(counts, device=DEVICE), config)
    want = reference(x, codes, exps, counts)
    assert got.dtype == dtype and got.shape == (sum(counts), n)
    tol = {"atol": 1e-3, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.skipif(INTERPRETED, reason="the PTX decode runs on NVIDIA GPUs only")
@pytest.mark.parametrize("config", [TileConfig(1, 32, 64, dot=False), TileConfig(16, 64, 128, dot=True),
                                    TileConfig(16, 64, 128, dot=True, group_scales=True),
                                    TileConfig(16, 64, 128, dot=True, bf16_ptx=True),
                                    TileConfig(16, 64, 128, dot=True, group_scales=True, bf16_ptx=True)],
                         ids=["gemv", "dot", "dot-group-scales", "dot-bf16-ptx", "dot-group-scales-bf16-ptx"])
def test_ptx_decode_equals_the_plain_decode(config):
    """The kernels' PTX decode (four code bytes at a time) gives the same float16 values as the
    plain Triton ops, so the same products bit for bit; every code and both nibbles occur."""
    torch.manual_seed(1)
    counts = [5, 0, 9]
    codes = torch.randint(0, 256, (3, 96, 128), dtype=torch.uint8, device=DEVICE)
    codes[0, 0, :] = torch.arange(128, dtype=torch.uint8, device=DEVICE)         # every code in both nibbles
    codes[0, 1, :] = torch.arange(128, 256, dtype=torch.uint8, device=DEVICE)
    exps = torch.randint(120, 134, (3, 96, 256 // 32), dtype=torch.uint8, device=DEVICE)
    x = torch.randn(sum(counts), 256, device=DEVICE).to(torch.bfloat16)
    tensor_counts = torch.tensor(counts, device=DEVICE)
    ptx = fp4_grouped_mm(x, codes, exps, tensor_counts, config, asm=True)
    plain = fp4_grouped_mm(x, codes, exps, tensor_counts, config, asm=False)
    assert torch.equal(ptx, plain)
    torch.testing.assert_close(ptx.float(), reference(x, codes, exps, counts), atol=0.1, rtol=2e-2)


FP8_CONFIGS = {"fp8-16": TileConfig(16, 64, 128, dot=True, fp8=True),
               "fp8-64": TileConfig(64, 32, 128, dot=True, fp8=True)}


@pytest.mark.parametrize("config", FP8_CONFIGS.values(), ids=FP8_CONFIGS.keys())
@pytest.mark.parametrize("counts,n,k", [([3, 0, 21, 1], 96, 256), ([5, 40, 0, 0, 7], 70, 128), ([2, 3], 32, 96)])
def test_fp4_grouped_mm_on_fp8_activations(counts, n, k, config):
    """The FP8 tensor-core path: the activations as fp8.quantize_rows makes them (per row and 128
    inputs, or the largest power of two dividing K), times the dequantized weights, to float32's
    summation order; and within the activations' rounding of the full-precision product."""
    from deepinfer.layers.quantization import fp8

    torch.manual_seed(sum(counts) + n + k)
    codes, exps = fp4.quantize(torch.randn(len(counts), n, k, device=DEVICE), 32)
    x = torch.randn(sum(counts), k, device=DEVICE)
    got = fp4_grouped_mm(x, codes, exps, torch.tensor(counts, device=DEVICE), config)
    block = 128 if k % 128 == 0 else 32
    xq, xs = fp8.quantize_rows_reference(x, block)
    x_seen = (xq.float().view(x.shape[0], -1, block) * xs[..., None]).view_as(x)
    # (Hopper's FP8 tensor cores add their products with less than float32's precision inside a
    # dot; each dot here spans one scale group, so the difference stays within a few 1e-4 relative.)
    torch.testing.assert_close(got, reference(x_seen, codes, exps, counts), atol=5e-3, rtol=1e-3)
    exact = reference(x, codes, exps, counts)
    assert ((got - exact).norm() / exact.norm()) < 0.05


def test_fp4_grouped_mm_refuses_shapes_it_cannot_tile():
    # 96 inputs in groups of 48: no power-of-two block holds whole groups.
    codes, exps = fp4.quantize(torch.randn(2, 32, 96, device=DEVICE), 48)
    with pytest.raises(ValueError, match="whole scale groups of 48"):
        fp4_grouped_mm(torch.randn(4, 96, device=DEVICE), codes, exps, torch.tensor([2, 2], device=DEVICE))


def test_fp4_grouped_mm_shrinks_its_k_block_to_small_experts():
    """96 inputs in groups of 32 (a small model's experts): tiled by 32."""
    codes, exps = fp4.quantize(torch.randn(2, 32, 96, device=DEVICE), 32)
    x = torch.randn(5, 96, device=DEVICE)
    got = fp4_grouped_mm(x, codes, exps, torch.tensor([2, 3], device=DEVICE))
    torch.testing.assert_close(got, reference(x, codes, exps, [2, 3]), atol=1e-3, rtol=1e-4)


def test_fp4_experts_grouped_forward_matches_their_loop():
    """RoutedExperts with FP4 weights: the grouped forward (two kernel launches, no host sync)
    against the reference loop over experts."""
    from types import SimpleNamespace

    from deepinfer.models.deepseek_v4.moe import RoutedExperts

    torch.manual_seed(3)
    cfg = SimpleNamespace(num_experts=6, hidden_size=128, moe_intermediate_size=128, swiglu_limit=7.0)
    experts = RoutedExperts(cfg).to(DEVICE)
    experts.as_fp4(32)
    for name in ("gate_up_proj", "down_proj"):
        codes, exps = fp4.quantize(torch.randn(getattr(experts, name).shape[:-1] + (128,), device=DEVICE) * 0.1, 32)
        getattr(experts, name).data.copy_(codes)
        getattr(experts, name.replace("_proj", "_exps")).copy_(exps)
    x = torch.randn(9, 128, device=DEVICE)
    ids = torch.randint(0, 6, (9, 2), device=DEVICE)
    weights = torch.rand(9, 2, device=DEVICE)
    torch.testing.assert_close(experts.forward_grouped(x, ids, weights), experts.forward_loop(x, ids, weights),
                               atol=1e-3, rtol=1e-4)


def test_the_kernel_checks_itself_before_the_engine_relies_on_it():
    from deepinfer.layers.quantization.fp4_moe_triton import kernel_works

    assert kernel_works(torch.device(DEVICE), LOW)


def test_the_self_check_covers_the_one_row_tiling_too(monkeypatch):
    """A kernel whose one-row tiling (the GEMV of batch-1 decode) multiplies wrongly fails the
    self-check, though its decode-batch tiling is right: the engine then dequantizes."""
    from deepinfer.layers.quantization import fp4_moe_triton

    right = fp4_moe_triton.fp4_grouped_mm

    def wrong_at_one_row(x, codes, exps, counts, *args, **kwargs):
        out = right(x, codes, exps, counts, *args, **kwargs)
        return out * 0 if x.shape[0] <= int((counts > 0).sum()) else out

    monkeypatch.setattr(fp4_moe_triton, "_works", {})
    monkeypatch.setattr(fp4_moe_triton, "fp4_grouped_mm", wrong_at_one_row)
    assert not fp4_moe_triton.kernel_works(torch.device(DEVICE), LOW)


def test_dequantize_kernel_matches_the_reference():
    from deepinfer.layers.quantization.fp4_moe_triton import dequantize

    codes, exps = fp4.quantize(torch.randn(3, 24, 128, device=DEVICE), 32)
    for dtype in (torch.float32, LOW):
        torch.testing.assert_close(dequantize(codes, exps, dtype), fp4.dequantize(codes, exps, dtype), atol=0, rtol=0)


NO_GROUPED_MM = not hasattr(torch, "_grouped_mm") or (DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9)


@pytest.mark.skipif(NO_GROUPED_MM, reason="no grouped GEMM here")
def test_dequantized_grouped_product_matches_the_reference(monkeypatch):
    """The prefill path: experts dequantized in chunks (two experts a chunk here, one of them
    without rows) and multiplied by torch's grouped GEMM."""
    from deepinfer.layers.quantization import fp4_moe_triton

    counts = [7, 0, 0, 5, 9]
    codes, exps = fp4.quantize(torch.randn(5, 64, 128, device=DEVICE), 32)
    monkeypatch.setattr(fp4_moe_triton, "DEQUANTIZED_BYTES", 2 * 64 * 128 * 4)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(sum(counts), 128, device=DEVICE).to(dtype)
    got = fp4_moe_triton.fp4_grouped_mm_dequantized(x, codes, exps, torch.tensor(counts, device=DEVICE))
    tol = {"atol": 1e-3, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), reference(x, codes, exps, counts), **tol)


@pytest.mark.skipif(DEVICE != "cuda" or NO_GROUPED_MM, reason="the overlapped chunks run on CUDA only")
def test_overlapped_dequantization_gives_the_sequential_products(monkeypatch):
    """A prefill's chunks dequantized on a side stream while the last chunk's GEMM runs: the same
    products, bit for bit, as one chunk after the other (five chunks over two scratch buffers, one
    chunk without rows)."""
    from deepinfer.layers.quantization import fp4_moe_triton

    counts = [7, 3, 0, 0, 5, 9, 2, 0, 4, 6]
    codes, exps = fp4.quantize(torch.randn(10, 64, 128, device=DEVICE), 32)
    monkeypatch.setattr(fp4_moe_triton, "DEQUANTIZED_BYTES", 2 * 64 * 128 * 2)
    monkeypatch.setattr(fp4_moe_triton, "OVERLAP_DEQUANTIZE", True)
    x = torch.randn(sum(counts), 128, device=DEVICE).to(torch.bfloat16)
    tensor_counts = torch.tensor(counts, device=DEVICE)
    overlapped = fp4_moe_triton.fp4_grouped_mm_dequantized(x, codes, exps, tensor_counts)
    monkeypatch.setattr(fp4_moe_triton, "OVERLAP_DEQUANTIZE", False)
    assert torch.equal(overlapped, fp4_moe_triton.fp4_grouped_mm_dequantized(x, codes, exps, tensor_counts))
