"""RMSNorm in one Triton kernel, optionally fused with the residual add that precedes it.

A decoder layer ends each half with `residual = residual + x` and starts the next with
`rms_norm(residual)`. In PyTorch that is an add plus a norm of several kernels, each reading the
row from memory again. Here one program owns one row: it loads x and the residual, writes their
sum back into the residual (in place), and normalises the sum while it is still in registers
(vLLM's `fused_add_rms_norm` does the same job).

Numerics follow the reference path (deepinfer/layers/norm.py): the sum is rounded to the
activation dtype before it is normalised (the reference adds in that dtype too), the mean of
squares and the scaling are done in float32, and the result is rounded once. Gemma's convention
(scale by 1 + w, all in float32) is the same kernel with `weight_offset=1.0`.

Rows may be rows of a 2D [tokens, hidden] tensor or the (token, head) vectors of a
[tokens, heads, head_dim] view, as the q/k norms of Qwen3 and Gemma 3 see them: those views come
from splitting the fused qkv output, so a token's heads are contiguous but tokens are not, and
the kernel addresses them with two strides instead of asking for a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer.layers.fused import pdl_enabled, pdl_launch


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    heads, stride_xt, stride_xh, stride_rt, stride_rh,
    n_cols, eps, weight_offset,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # Row -> (token, head); a 2D input has heads == 1 and a head stride of 0.
    token = row // heads
    head = row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset   # a constant
    if USE_PDL:   # see fused/__init__.py: nothing from earlier kernels is read before this
        gdc_wait()
        gdc_launch_dependents()

    x = tl.load(x_ptr + token * stride_xt + head * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:   # a constexpr: two compiled variants, no runtime branch
        r_ptrs = residual_ptr + token * stride_rt + head * stride_rh + cols
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        # The reference computes `residual + x` in the activation dtype: round the same way, and
        # normalise the rounded sum, so the residual stream matches it bit for bit.
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(r_ptrs, x, mask=mask)

    xf = x.to(tl.float32)
    # Masked columns were loaded as 0, so they add nothing to the sum of squares.
    mean_square = tl.sum(xf * xf, axis=0) / n_cols
    rstd = tl.rsqrt(mean_square + eps)
    out = xf * rstd
    if HAS_WEIGHT:
        out = out * w
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[int, int, int]:
    """(heads, token stride, head stride) of a 2D or 3D tensor whose last dim is contiguous."""
    if t.dim() == 2:
        return 1, t.stride(0), 0
    return t.shape[1], t.stride(0), t.stride(1)


def _num_warps(block: int) -> int:
    # About 16 elements per thread (two 16-byte loads of bf16): 1 warp for a head_dim of 128,
    # 2 for SmolLM2/Gemma's 576/640 (padded to 1024), 8 for Llama-3-8B's 4096, at most 16.
    return max(1, min(16, block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
             weight_offset: float = 0.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x) * (weight + weight_offset) over the last dim, in a new tensor of x's shape
    (weight None: no scaling, as DeepSeek-V4's per-head query norm).

    With `residual`: first `residual += x` in place, then the norm of that sum; returns
    (normed, residual). x may be [rows, n] or [tokens, heads, n] with any leading strides.
    """
    shape, n = x.shape, x.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        x = x.reshape(-1, n).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    heads, stride_xt, stride_xh = _row_layout(x)
    stride_rt = stride_rh = 0
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                             f"{tuple(x.shape)} {x.dtype} and be contiguous in its last dim")
        _, stride_rt, stride_rh = _row_layout(residual)
    rows = x.numel() // n if n else 0
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight if weight is not None else x, out,
            heads, stride_xt, stride_xh, stride_rt, stride_rh,
            n, eps, weight_offset,
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=_num_warps(block),
            USE_PDL=pdl_enabled(), **pdl_launch(),
        )
    out = out.view(shape)
    return out if residual is None else (out, residual)
