"""Block-scaled FP8 GEMM in Triton, for devices whose torch has no block-scaled _scaled_mm.

    y = (x_codes * x_scale) @ (w_codes * w_scale).T

x_codes [M, K] e4m3 with one scale per row and 128 inputs (fp8.quantize_rows), w_codes [N, K]
e4m3 with one scale per 128 x 128 block (DeepSeek-V4's checkpoints). Each program computes a
BLOCK_M x 128 tile of y: for every 128 inputs it multiplies the FP8 tiles on the tensor cores
(float32 accumulation), scales that partial product by the row scales of x and the block's scale
of w, and adds it up; the scales change only at 128-input boundaries, so the product is exact up
to the float32 sums. This is the recipe DeepSeek trains and serves V4 with.

Few rows (decode) leave most of the GPU idle with one program per 128 outputs (a 1024-output
projection: 8 programs), so the inputs are then also split (`splits` programs per tile, each
over a run of 128-input blocks) and their float32 partial products summed after: split-K, until
the grid has about TARGET_PROGRAMS programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128   # the weight's scale block, in both dimensions, and the kernel's N and K tiles
# Programs a split-K grid aims at: about two per SM of a Hopper card, so every SM has work.
TARGET_PROGRAMS = 264


@triton.jit
def _block_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, blocks_per_split, cols_per_group,
                      stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ys, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    # Grouped weights (block_fp8_mm's `groups`): this tile's outputs belong to one group, whose
    # own K inputs of each row of x (and their scales) it reads; group 0 for a plain product.
    group = pid_n * BLOCK_N // cols_per_group
    x_ptr += group * K
    xs_ptr += group * tl.cdiv(K, BLOCK_K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(K, BLOCK_K))
    for kb in range(first, last):
        k = kb * BLOCK_K + ks
        k_ok = k < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        a_scale = tl.load(xs_ptr + rows * stride_xsm + kb, mask=row_ok, other=0.0)
        b_scale = tl.load(ws_ptr + pid_n * stride_wsn + kb)     # BLOCK_N == the scale block
        acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale
    out = y_ptr + split * stride_ys + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_fp8_mm(x_codes: torch.Tensor, x_scale: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype, splits: int | None = None, groups: int = 1) -> torch.Tensor:
    """x_codes [M, K] e4m3, x_scale [M, ceil(K / 128)] float32, w_codes [N, K] e4m3, w_scale
    [ceil(N / 128), ceil(K / 128)] float32 -> [M, N] in out_dtype. `splits`: the inputs' split
    count (None: split_count's choice; 1: no split).

    groups > 1: a block-diagonal weight (DeepSeek-V4's grouped output projection). x_codes is
    [M, groups * K] (each row's groups side by side, scales likewise [M, groups * K / 128]), and
    group g's N / groups outputs multiply its own K inputs only; both N / groups and K are whole
    128-blocks, so a tile never straddles two groups."""
    m = x_codes.shape[0]
    n, k = w_codes.shape
    if x_codes.shape[1] != groups * k or (groups > 1 and ((n // groups) % BLOCK or n % groups or k % BLOCK)):
        raise ValueError(f"block_fp8_mm: x {tuple(x_codes.shape)} against {groups} group(s) of weight "
                         f"{tuple(w_codes.shape)} (grouped: whole 128-blocks per group)")
    if m == 0:
        return torch.empty(m, n, dtype=out_dtype, device=x_codes.device)
    block_m = 16 if m <= 16 else 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, BLOCK)
    k_blocks = triton.cdiv(k, BLOCK)
    splits = split_count(tiles, k_blocks) if splits is None else max(1, min(splits, k_blocks))
    per_split = triton.cdiv(k_blocks, splits)
    splits = triton.cdiv(k_blocks, per_split)
    # Split: float32 partial products, one [M, N] slice per split, summed below.
    y = torch.empty(splits, m, n, dtype=torch.float32 if splits > 1 else out_dtype, device=x_codes.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK), splits)
    x_scale, w_scale = x_scale.contiguous(), w_scale.contiguous()
    _block_fp8_kernel[grid](x_codes, x_scale, w_codes, w_scale, y, m, n, k, per_split, n // groups,
                            x_codes.stride(0), x_scale.stride(0), w_codes.stride(0), w_scale.stride(0),
                            y.stride(0), y.stride(1), BLOCK_M=block_m, BLOCK_N=BLOCK, BLOCK_K=BLOCK)
    return y[0] if splits == 1 else y.sum(dim=0).to(out_dtype)


def split_count(tiles: int, k_blocks: int) -> int:
    """Splits of the inputs for a grid of `tiles` output tiles: none once the tiles fill the GPU,
    else enough to reach about TARGET_PROGRAMS programs, each with at least one block of inputs."""
    if tiles >= TARGET_PROGRAMS // 2:
        return 1
    return max(1, min(k_blocks, TARGET_PROGRAMS // tiles))
