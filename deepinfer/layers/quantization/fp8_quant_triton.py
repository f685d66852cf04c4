"""The activations' FP8 quantization (fp8.quantize_rows) as one Triton kernel.

A scaled FP8 product first turns its bf16 activations into e4m3 codes with one scale per row
(per-channel weights) or per 128 inputs of a row (block weights). In PyTorch that is six passes
over a float32 copy of x (cast, abs, amax, divide, clamp, cast); at prefill sizes those passes
cost more than the FP8 product saves over bf16. Here each program reads its rows once (twice for
a whole-row scale: the second read comes from L2) and writes the codes and scales.

The arithmetic is the reference's, in float32: scale = max(amax * INV_FP8_MAX, MIN_SCALE), codes =
clamp(x / scale) rounded to nearest even (the division IEEE-rounded, div_rn, as torch's), so the
codes and scales are bit-identical to fp8.quantize_rows' (tests/unit/test_fp8_quant_kernel.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns a whole-row program reads per strip.
ROW_STRIP = 1024
# Groups of 128 a group program quantizes.
GROUPS_PER_PROGRAM = 8


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, groups_per_row, stride_xm, stride_qm, stride_sm,
                            fp8_max, inv_fp8_max, min_scale, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0)
    first = tl.program_id(1) * GROUPS
    g = first + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = g < groups_per_row
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=ok[:, None], other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) * inv_fp8_max, min_scale)
    codes = tl.clamp(tl.math.div_rn(x, scale[:, None]), -fp8_max, fp8_max)
    tl.store(q_ptr + row.to(tl.int64) * stride_qm + cols, codes.to(q_ptr.dtype.element_ty), mask=ok[:, None])
    tl.store(s_ptr + row * stride_sm + g, scale, mask=ok)


@triton.jit
def _quantize_row_kernel(x_ptr, q_ptr, s_ptr, cols, stride_xm, stride_qm, fp8_max, inv_fp8_max, min_scale,
                         STRIP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, STRIP)
    amax = tl.zeros((STRIP,), dtype=tl.float32)
    for k in range(0, cols, STRIP):
        x = tl.load(x_ptr + row * stride_xm + k + ks, mask=k + ks < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) * inv_fp8_max, min_scale)
    for k in range(0, cols, STRIP):
        x = tl.load(x_ptr + row * stride_xm + k + ks, mask=k + ks < cols, other=0.0).to(tl.float32)
        codes = tl.clamp(tl.math.div_rn(x, scale), -fp8_max, fp8_max)
        tl.store(q_ptr + row * stride_qm + k + ks, codes.to(q_ptr.dtype.element_ty), mask=k + ks < cols)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor, group: int | None, fp8_dtype: torch.dtype, fp8_max: float,
                  inv_fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (last dim contiguous) -> (codes [rows, cols] fp8_dtype, scales float32:
    [rows, 1], or [rows, cols / group] with `group`), as fp8.quantize_rows."""
    rows, cols = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    codes = torch.empty(rows, cols, dtype=fp8_dtype, device=x.device)
    if group is None:
        scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        if rows:
            strip = min(ROW_STRIP, triton.next_power_of_2(cols))
            _quantize_row_kernel[(rows,)](x, codes, scales, cols, x.stride(0), codes.stride(0), fp8_max, inv_fp8_max, min_scale,
                                          STRIP=strip, num_warps=4)
        return codes, scales
    if cols % group or group & (group - 1):
        raise ValueError(f"quantize_rows: {cols} columns are not whole groups of {group} (a power of two)")
    groups = cols // group
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        per = min(GROUPS_PER_PROGRAM, triton.next_power_of_2(groups))
        _quantize_groups_kernel[(rows, triton.cdiv(groups, per))](
            x, codes, scales, groups, x.stride(0), codes.stride(0), scales.stride(0), fp8_max, inv_fp8_max, min_scale,
            GROUP=group, GROUPS=per, num_warps=4)
    return codes, scales
