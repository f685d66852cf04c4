"""Block-scaled FP8 GEMM in Triton, for devices whose torch has no block-scaled _scaled_mm.

    y = (x_codes * x_scale) @ (w_codes * w_scale).T

x_codes [M, K] e4m3 with one scale per row and 128 inputs (fp8.quantize_rows), w_codes [N, K]
e4m3 with one scale per 128 x 128 block (DeepSeek-V4's checkpoints). Each program computes a
BLOCK_M x 128 tile of y: for every 128 inputs it multiplies the FP8 tiles on the tensor cores
(float32 accumulation), scales that partial product by the row scales of x and the block's scale
of w, and adds it up; the scales change only at 128-input boundaries, so the product is exact up
to the float32 sums. This is the recipe DeepSeek trains and serves V4 with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128   # the weight's scale block, in both dimensions, and the kernel's N and K tiles


@triton.jit
def _block_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K,
                      stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + ks
        k_ok = k < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        a_scale = tl.load(xs_ptr + rows * stride_xsm + kb, mask=row_ok, other=0.0)
        b_scale = tl.load(ws_ptr + pid_n * stride_wsn + kb)     # BLOCK_N == the scale block
        acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale
    out = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_fp8_mm(x_codes: torch.Tensor, x_scale: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """x_codes [M, K] e4m3, x_scale [M, ceil(K / 128)] float32, w_codes [N, K] e4m3, w_scale
    [ceil(N / 128), ceil(K / 128)] float32 -> [M, N] in out_dtype."""
    m, k = x_codes.shape
    n = w_codes.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=x_codes.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK))
    x_scale, w_scale = x_scale.contiguous(), w_scale.contiguous()
    _block_fp8_kernel[grid](x_codes, x_scale, w_codes, w_scale, y, m, n, k,
                            x_codes.stride(0), x_scale.stride(0), w_codes.stride(0), w_scale.stride(0), y.stride(0),
                            BLOCK_M=block_m, BLOCK_N=BLOCK, BLOCK_K=BLOCK)
    return y

