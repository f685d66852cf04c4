"""FP8 e4m3 weights with float32 scales, and their matrix products.

A weight [out, in] is kept as float8_e4m3fn codes and the multipliers that give it back,
w = codes * scale, at one of two granularities:
  per channel  scale [out, 1], one per output row: what `--quantization fp8` makes of a bf16
               checkpoint at load (`quantize_per_channel`), vLLM's dynamic FP8;
  per block    scale [ceil(out / bn), ceil(in / bk)], one per bn x bk block: what DeepSeek-V4's
               checkpoints ship (128 x 128, models/deepseek_v4/weights.py).
The codes are the weight's only device copy: no bf16 weight is kept beside them.

Two ways to multiply, chosen per call by what the inputs allow (`fp8_linear`):
  reference  dequantize the weight to the activations' dtype and take F.linear: exact for the
             stored weight, on any device and dtype; the path the fast one is tested against;
  scaled mm  the activations quantized to FP8 too (one scale per row for per-channel weights,
             one per 128 columns of a row for per-block ones: the granularities torch's
             _scaled_mm pairs with the weight's), then one FP8 GEMM with the scales applied in
             its epilogue (torch._scaled_mm: cuBLASLt / CUTLASS on Hopper, oneDNN on the CPU for
             per-channel). It reads half the bytes of a bf16 weight and, on Hopper, runs on the
             FP8 tensor cores. Its products differ from the reference by the activations'
             rounding to FP8 (three mantissa bits), which tests bound.
Block-scaled products run on torch's _scaled_mm where the build and device implement it, else on
CUDA on a Triton kernel of the same recipe (fp8_block_triton.py); `block_path` asks once per device
with a small product against the reference, which serves where neither runs.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# A scale is amax times this float32 reciprocal, in the reference and the kernel alike: torch
# divides a CUDA tensor by a Python number as a product with its reciprocal, so a division would
# round differently on the CPU, on CUDA and in a kernel's IEEE division.
INV_FP8_MAX = float(np.float32(1.0) / np.float32(FP8_MAX))
# The smallest activation scale: a row of zeros quantizes to zeros, not to NaN (0 / 0).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# The activations' group along the inputs for block-scaled weights (DeepSeek's recipe: 1 x 128).
ACTIVATION_GROUP = 128
# _scaled_mm's shape rule: both dimensions of the weight multiples of this.
ALIGNMENT = 16

# The ways to multiply block-scaled FP8, tried in this order on each device (block_path): torch's
# _scaled_mm with the scales as computed (row-major) or each scale matrix stored transposed
# (outer-dimension-major, which some builds ask for), then the Triton kernel (CUDA).
BLOCK_PATHS = ("row_major", "outer_major", "triton")
# Per device: the first of BLOCK_PATHS that ran and matched the reference, or None.
_block_paths: dict[str, str | None] = {}

def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in] float8_e4m3fn, scale [out, 1] float32) with codes * scale ~ weight: each
    row scaled so its largest magnitude is FP8's largest."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight the codes and scales stand for, in `dtype` (computed in float32)."""
    w = codes.float()
    if block is None:
        return (w * scale).to(dtype)
    rows, cols = w.shape
    bn, bk = block
    full = scale.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]
    return (w * full).to(dtype)


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [rows, cols] -> (codes, scales): one scale per row ([rows, 1]), or one per
    `group` columns of a row ([rows, cols / group]); computed on the device, no host sync. On
    CUDA one Triton kernel (fp8_quant_triton.py: the same codes and scales, one pass over x
    instead of six), elsewhere quantize_rows_reference."""
    if x.is_cuda:
        from deepinfer.layers.quantization import fp8_quant_triton

        return fp8_quant_triton.quantize_rows(x, group, FP8, FP8_MAX, INV_FP8_MAX, MIN_SCALE)
    return quantize_rows_reference(x, group)


def quantize_rows_reference(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in PyTorch ops: the reference the kernel is tested against."""
    rows, cols = x.shape
    xf = x.float() if group is None else x.float().view(rows, cols // group, group)
    scale = (xf.abs().amax(dim=-1, keepdim=group is None) * INV_FP8_MAX).clamp(min=MIN_SCALE)
    scaled = xf / (scale if group is None else scale[..., None])
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, cols), scale


def _scaled_mm_shape_ok(x: torch.Tensor, codes: torch.Tensor) -> bool:
    out, inner = codes.shape
    return x.dim() == 2 and out % ALIGNMENT == 0 and inner % ALIGNMENT == 0


def per_channel_fast(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether a per-channel product of these activations runs as a scaled mm: bf16 activations
    (the output dtype _scaled_mm takes with row-wise scales) of aligned shapes, on a device whose
    torch build has row-wise scaled mm (row_wise_available)."""
    return x.dtype == torch.bfloat16 and _scaled_mm_shape_ok(x, codes) and row_wise_available(x.device)


# Per device: whether torch's _scaled_mm takes row-wise scales there (asked once).
_row_wise: dict[str, bool] = {}


def row_wise_available(device: torch.device) -> bool:
    """Whether _scaled_mm with one scale per row of x and per output channel runs on `device` in
    this torch build (CPU builds differ: some take per-tensor scales only), tried once a device on
    a small product; where it does not, per-channel FP8 weights take the dequantized reference."""
    key = str(device)
    if key not in _row_wise:
        codes, scale = quantize_per_channel(torch.ones(16, 32, device=device))
        try:
            _per_channel_mm(torch.ones(16, 32, device=device, dtype=torch.bfloat16), codes, scale, None)
            _row_wise[key] = True
        except RuntimeError as e:
            logger.info("no row-wise FP8 scaled mm on %s (%s); per-channel FP8 weights are dequantized per product",
                        device, str(e).splitlines()[0][:100])
            _row_wise[key] = False
    return _row_wise[key]


def blockwise_fast(x: torch.Tensor, codes: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether a block-scaled product runs as an FP8 GEMM: 128 x 128 weight blocks, inputs a
    multiple of 128, bf16 activations, and a device with a block-scaled product."""
    return (block == (128, 128) and x.dtype == torch.bfloat16 and _scaled_mm_shape_ok(x, codes)
            and codes.shape[1] % ACTIVATION_GROUP == 0 and block_product_available(x.device))


def block_product_available(device: torch.device) -> bool:
    """Whether this device multiplies block-scaled FP8 (block_path)."""
    return block_path(device) is not None


def block_path(device: torch.device) -> str | None:
    """The first of BLOCK_PATHS that runs on this device and matches the dequantized reference on
    a small product, found once a device; None: none does, and FP8 block weights are dequantized
    per product. A build or a card that cannot run one (no block-scaled _scaled_mm, no Triton, no
    FP8 dots) is thus never asked to in a step."""
    key = str(device)
    if key not in _block_paths:
        generator = torch.Generator(device=device).manual_seed(0)
        codes, scale = quantize_blocks(torch.randn(256, 384, device=device, generator=generator), (128, 128))
        x = torch.randn(24, 384, device=device, generator=generator).to(torch.bfloat16)
        want = block_reference(x, codes, scale)
        reasons, _block_paths[key] = [], None
        for path in BLOCK_PATHS:
            if path == "triton" and device.type != "cuda":
                continue
            try:
                got = _blockwise_mm(x, codes, scale, None, path)
            except Exception as e:   # not in this build, or cannot be compiled here
                reasons.append(f"{path}: {str(e).splitlines()[0][:100] if str(e) else type(e).__name__}")
                continue
            if torch.allclose(got.float(), want, rtol=0.02, atol=0.05):
                _block_paths[key] = path
                break
            reasons.append(f"{path}: wrong products")
        if _block_paths[key] is None:
            logger.info("no block-scaled FP8 GEMM on %s (%s); FP8 block weights are dequantized per product",
                        device, "; ".join(reasons))
    return _block_paths[key]


def block_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What a block-scaled FP8 product of x [rows, in] must give, in float32: the activations
    rounded to FP8 as the product rounds them (per row and 128 inputs), times the dequantized
    weight. Any path's result differs from it only by float32 sums and the output's rounding (a
    product checked against the unrounded activations instead is off by their FP8 rounding, a few
    percent of a term, which no tolerance that catches a wrong layout allows)."""
    xq, xs = quantize_rows_reference(x, ACTIVATION_GROUP)
    rows, cols = x.shape
    xr = (xq.float().view(rows, -1, ACTIVATION_GROUP) * xs[..., None]).view(rows, cols)
    return F.linear(xr, dequantize(codes, scale, (128, 128), torch.float32))


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale [ceil(out / bn), ceil(in / bk)]) for a float weight: each block scaled so its
    largest magnitude is FP8's largest (tests and the support probe write V4-style weights)."""
    rows, cols = weight.shape
    bn, bk = block
    padded = F.pad(weight.float(), (0, -cols % bk, 0, -rows % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes.view(padded.shape)[:rows, :cols].contiguous(), scale


def _per_channel_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    xq, xs = quantize_rows(x)
    return torch._scaled_mm(xq, codes.t(), scale_a=xs, scale_b=scale.view(1, -1), bias=bias,
                            out_dtype=x.dtype)


def _blockwise_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  path: str | None = None) -> torch.Tensor:
    """The block-scaled product by `path` (default: the device's, block_path)."""
    path = path or _block_paths[str(x.device)]
    xq, xs = quantize_rows(x, ACTIVATION_GROUP)
    if path == "triton":
        from deepinfer.layers.quantization.fp8_block_triton import block_fp8_mm

        y = block_fp8_mm(xq, xs, codes, scale, x.dtype)
    else:
        # scale_b is the transposed weight's: [in / 128, out / 128].
        scale_b = scale.t().contiguous()
        if path == "outer_major":
            xs, scale_b = xs.t().contiguous().t(), scale.t()
        y = torch._scaled_mm(xq, codes.t(), scale_a=xs, scale_b=scale_b, out_dtype=x.dtype)
    return y if bias is None else y + bias


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None, reference: bool = False) -> torch.Tensor:
    """x @ (codes * scale).T (+ bias) for x [..., in]: the scaled mm where the inputs allow it
    (module docstring), else, or with reference=True, the dequantized weight's F.linear."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if not reference and flat.shape[0] > 0:
        if block is None and per_channel_fast(flat, codes):
            return _per_channel_mm(flat, codes, scale, bias).view(*lead, -1)
        if block is not None and blockwise_fast(flat, codes, block):
            return _blockwise_mm(flat, codes, scale, bias).view(*lead, -1)
    return F.linear(x, dequantize(codes, scale, block, x.dtype), bias)


def fp8_grouped_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                       reference: bool = False) -> torch.Tensor:
    """A block-diagonal product (DeepSeek-V4's grouped output projection): x [..., G, K], the
    weight (codes * scale) [G * O, K] whose rows g*O .. (g+1)*O belong to group g -> [..., G, O],
    each group's inputs times its own rows. Where a group holds whole 128 x 128 blocks and the
    device has the Triton block kernel, one launch over every group (fp8_block_triton.py, its
    `groups`); with torch's block-scaled _scaled_mm, one product per group; else, or with
    reference=True, the dequantized weight's einsum."""
    groups, k = x.shape[-2:]
    n = codes.shape[0]
    per = n // groups
    rows = x.reshape(-1, groups * k)
    whole_blocks = block == (128, 128) and per % 128 == 0 and k % ACTIVATION_GROUP == 0
    if not reference and rows.shape[0] > 0 and whole_blocks and blockwise_fast(rows[:, :k], codes, block):
        if block_path(x.device) == "triton":
            from deepinfer.layers.quantization.fp8_block_triton import block_fp8_mm

            xq, xs = quantize_rows(rows, ACTIVATION_GROUP)
            return block_fp8_mm(xq, xs, codes, scale, x.dtype, groups=groups).view(*x.shape[:-1], per)
        parts = [_blockwise_mm(rows[:, g * k:(g + 1) * k].contiguous(), codes[g * per:(g + 1) * per],
                               scale[g * per // 128:(g + 1) * per // 128], None) for g in range(groups)]
        return torch.stack(parts, dim=1).view(*x.shape[:-1], per)
    w = dequantize(codes, scale, block, x.dtype).view(groups, per, k)
    return torch.einsum("...gi,goi->...go", x, w)
