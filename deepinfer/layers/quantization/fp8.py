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
Block-scaled scaled mm needs a torch build and device that implement it; `blockwise_supported`
asks once per device with a small product and the reference serves where it is missing.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# The smallest activation scale: a row of zeros quantizes to zeros, not to NaN (0 / 0).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# The activations' group along the inputs for block-scaled weights (DeepSeek's recipe: 1 x 128).
ACTIVATION_GROUP = 128
# _scaled_mm's shape rule: both dimensions of the weight multiples of this.
ALIGNMENT = 16

# Per device: the scale layout block-scaled _scaled_mm takes there (False: none works).
_blockwise_layout: dict[str, str | bool] = {}
# Scale layouts to try, in order: as computed (row-major), or outer-dimension-major (each scale
# matrix stored transposed), which some builds of the block-scaled GEMM ask for.
SCALE_LAYOUTS = ("row_major", "outer_major")


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
    `group` columns of a row ([rows, cols / group]); computed on the device, no host sync."""
    rows, cols = x.shape
    xf = x.float() if group is None else x.float().view(rows, cols // group, group)
    scale = (xf.abs().amax(dim=-1, keepdim=group is None) / FP8_MAX).clamp(min=MIN_SCALE)
    scaled = xf / (scale if group is None else scale[..., None])
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, cols), scale


def _scaled_mm_shape_ok(x: torch.Tensor, codes: torch.Tensor) -> bool:
    out, inner = codes.shape
    return x.dim() == 2 and out % ALIGNMENT == 0 and inner % ALIGNMENT == 0


def per_channel_fast(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether a per-channel product of these activations runs as a scaled mm: bf16 activations
    (the output dtype _scaled_mm takes with row-wise scales) of aligned shapes."""
    return x.dtype == torch.bfloat16 and _scaled_mm_shape_ok(x, codes)


def blockwise_fast(x: torch.Tensor, codes: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether a block-scaled product runs as a scaled mm: 128 x 128 weight blocks, inputs a
    multiple of 128, bf16 activations, and a device whose _scaled_mm takes block scales."""
    return (block == (128, 128) and x.dtype == torch.bfloat16 and _scaled_mm_shape_ok(x, codes)
            and codes.shape[1] % ACTIVATION_GROUP == 0 and blockwise_supported(x.device))


def blockwise_supported(device: torch.device) -> bool:
    """Whether _scaled_mm multiplies 1 x 128-scaled activations by 128 x 128-scaled weights on
    this device, with either scale layout: asked once (a small product against the reference),
    then remembered."""
    key = str(device)
    if key not in _blockwise_layout:
        _blockwise_layout[key] = False
        reasons = []
        x = torch.randn(16, 256, device=device, dtype=torch.bfloat16)
        codes, scale = quantize_blocks(torch.randn(256, 256, device=device), (128, 128))
        want = F.linear(x.float(), dequantize(codes, scale, (128, 128), torch.float32))
        for layout in SCALE_LAYOUTS:
            try:
                got = _blockwise_mm(x, codes, scale, None, layout)
            except (RuntimeError, NotImplementedError, ValueError) as e:
                reasons.append(f"{layout}: {str(e).splitlines()[0][:100]}")
                continue
            if torch.allclose(got.float(), want, rtol=0.1, atol=0.5):
                _blockwise_layout[key] = layout
                break
            reasons.append(f"{layout}: wrong products")
        if not _blockwise_layout[key]:
            logger.info("block-scaled FP8 GEMM not available on %s (%s); FP8 block weights are "
                        "dequantized per product", device, "; ".join(reasons))
    return bool(_blockwise_layout[key])


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
                  layout: str | None = None) -> torch.Tensor:
    xq, xs = quantize_rows(x, ACTIVATION_GROUP)
    # scale_b is the transposed weight's: [in / 128, out / 128].
    scale_b = scale.t()
    if (layout or _blockwise_layout.get(str(x.device))) == "outer_major":
        xs, scale_b = xs.t().contiguous().t(), scale_b.t().contiguous().t()
    else:
        scale_b = scale_b.contiguous()
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
